"""The engine a generator samples with, by the config: batch mode's ``Engine``, continuous mode's ``Stream``.

The one place that maps ``simulation.generator``, ``weights.apply_mode`` and ``generator.mode`` to
an implementation (``asyncrl.generators.engines.base``); a new engine is added here.
"""

from __future__ import annotations


def build_engine(cfg, model_dir: str, gen_index: int):
    """Batch mode's engine: the simulated one, or vLLM (the async engine when weights are swapped in flight)."""
    if cfg.simulation.generator is not None:
        from asyncrl.generators.engines.mock_engine import MockEngine

        return MockEngine(cfg.simulation.generator, seed=cfg.run.seed + gen_index)
    from asyncrl.generators.engines.vllm_engine import VLLMEngine

    engine_cls = VLLMEngine
    if cfg.weights.apply_mode == "in_flight" or cfg.plays_episodes:  # multi-turn rollouts: one async request a turn
        from asyncrl.generators.engines.async_vllm_engine import AsyncVLLMEngine as engine_cls
    return engine_cls(
        model_dir, cfg.engine.model_copy(update={"seed": cfg.run.seed + gen_index}), lora_rank=lora_rank(cfg)
    )


def build_stream(cfg, model_dir: str, gen_index: int):
    """The engine a generator drives continuously, behind its stream: the simulated engine, or
    vLLM's ``AsyncLLM`` reporting its load. ``stream.engine`` is the engine."""
    if cfg.simulation.generator is not None:
        from asyncrl.generators.engines.mock_engine import MockEngine
        from asyncrl.generators.engines.mock_stream import MockStream

        return MockStream(MockEngine(cfg.simulation.generator, seed=cfg.run.seed + gen_index))
    from asyncrl.generators.engines.vllm_stream import build_stream as build_vllm_stream

    stream = build_vllm_stream(
        model_dir, cfg.engine.model_copy(update={"seed": cfg.run.seed + gen_index}), lora_rank=lora_rank(cfg)
    )
    stream.answers_apart = cfg.generator.partial_rollouts == "resume"  # each answer interruptible
    return stream


def lora_rank(cfg) -> int | None:
    """``model.lora.rank`` when the learner trains a LoRA adapter (each version is then only the
    adapter: the engine must serve adapters of that rank), else None."""
    lora = getattr(cfg.model, "lora", None)
    return None if lora is None else int(lora.rank)
