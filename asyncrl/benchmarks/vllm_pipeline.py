"""``asyncrl bench pipeline --engine vllm``: pipeline overhead with real vLLM generators.

The same run measures two things on the same engine settings, prompts (the dispatcher's seeded
order) and sampling settings:

- **pipeline**: the full asynchronous pipeline (``configs/bench_vllm.yaml``: real vLLM generator
  processes, real dispatcher, transport, reward worker, buffer, learner loop and weight
  broadcast) with a simulated learner fast enough never to be the bottleneck. The learner
  publishes the model's real tensors (``simulation.learner.weights_from``), so each generator
  really receives and loads every broadcast. Tokens/s is response tokens trained per second over
  the steady state (``asyncrl.benchmarks.measured_run``).
- **alone**: the same number of vLLM engines, each in its own process started with the
  generators' environment, calling ``generate`` back to back on the same prompts, k at a time,
  with the same seeds, no weight updates and nothing else running; once before and once after
  the pipeline, so a drift in the machine's load shows as a difference between the two.

overhead = 1 − pipeline tokens/s ÷ alone tokens/s. It counts everything the pipeline adds
around generation: asking for prompts, sending groups, weight reloads and the pause they imply.
On a machine shared with other jobs the wall-clock figure moves with their load, so the same
ratio is also given per CPU second of the generator processes (``overhead_per_cpu_s``: the work
the pipeline adds inside a generator process), with the cores the rest of the control plane used
(``control_plane_cores``; on a GPU host, spare host cores), and the share of the generators'
own time spent outside ``generate()`` (``overhead_in_generator_loop``), which that load does not blur.
What it leaves out on purpose is training compute: on a cluster the learner runs on its own
devices, and here a real learner on the same two CPU cores would measure the machine's
contention, not the pipeline; the simulated learner keeps the weight path real and the CPU free.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from asyncrl.config import RunConfig, dump_config, load_config, load_run_config


def make_engine(cfg: RunConfig, model_dir: str, gen_index: int):
    """The engine a generator process builds (``worker.run_generator``), with its seed."""
    from asyncrl.generators.engines.vllm_engine import VLLMEngine

    engine_cls = VLLMEngine
    if getattr(cfg.weights, "apply_mode", "between_requests") == "in_flight":
        from asyncrl.generators.engines.async_vllm_engine import AsyncVLLMEngine as engine_cls
    return engine_cls(model_dir, cfg.engine.model_copy(update={"seed": cfg.run.seed + gen_index}))


def generate_alone(cfg: RunConfig, model_dir: str, calls: int, gen_index: int = 0) -> dict:
    """One engine generating ``calls`` batches back to back, after one warm-up call, on the
    prompts the dispatcher would hand out, k per call, with the generator loop's seeds."""
    from asyncrl.dispatcher.cursor import PromptCursor
    from asyncrl.tasks.prompts import load_run_prompts

    engine = make_engine(cfg, model_dir, gen_index)
    cursor = PromptCursor(load_run_prompts(cfg, "train", model_dir), cfg.run.seed, cfg.dispatcher.epochs)
    k = cfg.generator.prompts_per_batch
    tokens = samples = 0
    for batch in range(calls + 1):
        if batch == 1:  # the warm-up call (first-use allocations) is left out, as the pipeline's fill is
            start, cpu_start = time.perf_counter(), time.process_time()
        prompts = [p.text for p in cursor.take(k)]
        out = engine.generate(prompts, cfg.sampling, seed=hash((cfg.run.seed, gen_index, batch)) & 0x7FFFFFFF)
        if batch >= 1:
            tokens += sum(len(c.response_ids) for group in out for c in group)
            samples += sum(len(group) for group in out)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    engine.close()
    return {
        "tokens_per_s": tokens / wall,
        "samples_per_s": samples / wall,
        "tokens_per_cpu_s": tokens / cpu,
        "calls": calls,
        "wall_s": wall,
        "cpu_s": cpu,
    }


def run_alone(cfg: RunConfig, model_dir: Path, calls: int, work: Path) -> dict:
    """``generate_alone`` in one process per generator, with the generators' environment."""
    from asyncrl.controller.preparation import child_env

    work.mkdir(parents=True, exist_ok=True)
    (work / "config.yaml").write_text(dump_config(cfg))
    procs = []
    for i in range(cfg.run.num_generators):
        cmd = [
            sys.executable,
            "-m",
            "asyncrl.benchmarks.vllm_pipeline",
            str(work / "config.yaml"),
            str(model_dir),
            str(calls),
            str(i),
        ]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, env=child_env(work), cwd=os.getcwd()))
    results = []
    for p in procs:
        stdout, _ = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"vLLM alone (pid {p.pid}) exited with {p.returncode}; see its output above")
        results.append(json.loads(stdout.decode().strip().splitlines()[-1]))
    return {
        "tokens_per_s": sum(r["tokens_per_s"] for r in results),
        "samples_per_s": sum(r["samples_per_s"] for r in results),
        "tokens_per_cpu_s": sum(r["tokens_per_cpu_s"] for r in results) / len(results),
        "per_engine": results,
    }


def run_vllm_bench(recipe: str, overrides: list[str], out: Path) -> dict:
    from asyncrl.benchmarks.measured_run import run_measured
    from asyncrl.models.fetch import resolve_model_path
    from asyncrl.models.tiny import build_tiny_model

    cfg = load_config(recipe, overrides)
    model_dir = (
        resolve_model_path(cfg.model.path) if cfg.model.path else build_tiny_model(cfg.model.tiny, out / "model")
    )
    cfg = load_config(
        recipe,
        [
            *overrides,
            f"model.path={model_dir.resolve()}",
            f"simulation.learner.weights_from={model_dir.resolve()}",
            f"run.root={out}",
        ],
    )
    if cfg.simulation.generator is not None or cfg.simulation.learner is None:
        raise ValueError("--engine vllm needs simulation.generator unset (real engines) and simulation.learner set")
    calls = (
        cfg.learner.total_steps * cfg.learner.batch_groups // (cfg.generator.prompts_per_batch * cfg.run.num_generators)
    )
    from asyncrl.benchmarks.steady_state import machine_load

    load_start = machine_load()
    before = run_alone(cfg, model_dir, calls, out / "alone-before")
    pipeline = run_measured(cfg)
    after = run_alone(cfg, model_dir, calls, out / "alone-after")
    alone = (before["tokens_per_s"] + after["tokens_per_s"]) / 2
    alone_per_cpu = (before["tokens_per_cpu_s"] + after["tokens_per_cpu_s"]) / 2
    # Response tokens per CPU second of the generator processes over the steady state.
    gen_cpu_s_per_s = pipeline["cpu_us_per_sample"]["generator"] * 1e-6 * pipeline["samples_per_s"]
    pipeline_per_cpu = pipeline["tokens_per_s"] / gen_cpu_s_per_s / cfg.run.num_generators
    result = {
        "definition": "overhead = 1 - pipeline tokens/s / alone tokens/s (mean of the runs before and after); "
        "alone = the same engines, prompts, seeds and sampling, generate() back to back, no weight updates; "
        "the pipeline's learner is simulated (no training compute) but publishes the real weights every "
        f"{cfg.learner.broadcast_every} step(s), which each generator loads",
        "generators": cfg.run.num_generators,
        "prompts_per_call": cfg.generator.prompts_per_batch,
        "sampling": cfg.sampling.model_dump(),
        "pipeline": pipeline,
        "alone_before": before,
        "alone_after": after,
        "alone_tokens_per_s": alone,
        "pipeline_tokens_per_s": pipeline["tokens_per_s"],
        "overhead": 1 - pipeline["tokens_per_s"] / alone,
        "alone_tokens_per_cpu_s": alone_per_cpu,
        "pipeline_tokens_per_cpu_s": pipeline_per_cpu,
        "overhead_per_cpu_s": 1 - pipeline_per_cpu / alone_per_cpu,
        "control_plane_cores": pipeline["control_plane_cpu_us_per_sample"] * 1e-6 * pipeline["samples_per_s"],
        # Share of the generators' own time outside generate() over the same window: the part of
        # the overhead that another job's load on the machine does not blur.
        "overhead_in_generator_loop": 1 - pipeline["generator_busy_fraction"],
        "goal_overhead": 0.10,
        "machine_at_start": load_start,
        "machine_at_end": machine_load(),
    }
    (out / "pipeline_vllm.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":  # one "alone" engine: CONFIG MODEL_DIR CALLS GEN_INDEX; prints JSON
    config, model, n_calls, index = sys.argv[1:5]
    print(json.dumps(generate_alone(load_run_config(config), model, int(n_calls), int(index))))
