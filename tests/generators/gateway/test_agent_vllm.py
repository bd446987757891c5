"""An agent program's episodes on a real vLLM AsyncLLM (CPU build): its calls through the gateway
are requests after exactly the ids kept so far (the sampled ones as vLLM returned them, the rest of
the agent's prompt tokenized alone), sampled with the run's settings; its reward is the episode's."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import vllm  # noqa: E402,F401  (a missing vLLM fails here: CI installs it, nothing is skipped)

from asyncrl.generators.config import AgentConfig  # noqa: E402
from asyncrl.generators.engines.vllm_engine import EngineConfig, SamplingConfig  # noqa: E402
from asyncrl.generators.engines.vllm_stream import build_stream  # noqa: E402
from asyncrl.generators.gateway.agent_rollout import AgentGroups  # noqa: E402
from asyncrl.models.tiny import TinyModelConfig, build_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow  # a vLLM engine (~30 s)

PROMPT = "12+34="
AGENT = Path(__file__).resolve().parents[2] / "fixtures" / "agents" / "scripted_agent.py"


@pytest.fixture(scope="module")
def stream(tmp_path_factory):
    model = build_tiny_model(TinyModelConfig(seed=1, max_position_embeddings=256), tmp_path_factory.mktemp("model"))
    s = build_stream(str(model), EngineConfig(max_model_len=256, block_size=32, kv_cache_memory_bytes=64 << 20))
    yield s
    s.close()


def test_an_agent_programs_calls_are_sampled_token_in_token_out(stream, monkeypatch):
    tokenizer = stream.engine.tokenizer
    cfg = AgentConfig(command=[sys.executable, str(AGENT), "text"], episode_timeout_s=120)
    agents = AgentGroups(stream.engine, cfg, SamplingConfig(n=2, temperature=0.8, max_tokens=6), max_model_len=256)
    asked, sample_request = {}, stream.engine.sample_request

    async def recording(prompt_ids, params, request_id, oldest=None):
        asked[request_id] = (list(prompt_ids), params)
        return await sample_request(prompt_ids, params, request_id, oldest)

    monkeypatch.setattr(stream.engine, "sample_request", recording)
    try:
        stream.submit_rollout("ag", {"text": PROMPT, "answer": "46", "group_id": "ag"}, agents, seed=7)
        ((key, group, _),) = stream.finished(timeout=180)
    finally:
        stream.engine.submit(agents.close()).result(timeout=30)
    prompt = tokenizer.encode(PROMPT)
    assert key == "ag" and [c.episode_index for c in group] == [0, 1]
    assert len(asked) == 4  # two calls in each of two episodes
    for episode in group:
        # The agent sent the row's prompt as it is: part 0, after the group's prompt ids.
        assert (episode.part, episode.turns, episode.env_reward, episode.env_error) == (0, 2, 0.5, None)
        assert episode.prompt_ids.tolist() == prompt
        ids, mask = episode.response_ids.tolist(), episode.loss_mask.tolist()
        start = next(t for t in range(1, len(ids)) if mask[t] and not mask[t - 1])
        contexts = {tuple(c) for k, (c, _) in asked.items() if k.startswith(f"ag/{episode.episode_index}/")}
        assert contexts == {tuple(prompt), tuple(prompt + ids[:start])}  # token in, token out
        assert tokenizer.decode([i for i, m in zip(ids, mask) if not m]) == "\nsure?\n"
        lp = episode.logprobs
        assert np.all(lp[episode.loss_mask == 0] == 0) and np.all(lp[episode.loss_mask == 1] < 0)
    assert {(p.temperature, p.top_p, p.n) for _, p in asked.values()} == {(0.8, 1.0, 1)}  # the run's settings
