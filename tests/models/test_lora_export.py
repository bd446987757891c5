"""``asyncrl export`` of a LoRA run: the adapter in peft's format, or with ``--merge`` a merged
model that transformers and vLLM load and that scores as the adapted model does."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import re  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from peft import PeftModel  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from asyncrl.cli import main  # noqa: E402
from asyncrl.config import dump_config, load_config  # noqa: E402
from asyncrl.models.lora import adapter_parameters, apply_lora, write_lora_model  # noqa: E402
from asyncrl.models.tiny import TinyModelConfig, build_tiny_model  # noqa: E402

PROMPT = "07+45="


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A finished LoRA run's layout: the starting model, the final merged model and its adapter
    (random, non-zero)."""
    run = tmp_path_factory.mktemp("run")
    cfg = load_config(None, ["model.lora.rank=4", "model.lora.alpha=8"])
    (run / "config.yaml").write_text(dump_config(cfg))
    warm = build_tiny_model(TinyModelConfig(), run / "model" / "warm")
    model = apply_lora(AutoModelForCausalLM.from_pretrained(warm), cfg.model.lora)
    gen = torch.Generator().manual_seed(0)
    tensors = {name: 0.05 * torch.randn(p.shape, generator=gen) for name, p in adapter_parameters(model)}
    write_lora_model(tensors, cfg.model.lora, warm, run / "final")
    return run


def logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits.float()[0], -1)


def test_adapter_export_loads_with_peft_and_merged_export_scores_alike(lora_run, tmp_path, capsys):
    assert main(["export", str(lora_run), str(tmp_path / "adapter")]) == 0
    assert main(["export", str(lora_run), str(tmp_path / "merged"), "--merge"]) == 0
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    warm = lora_run / "model" / "warm"
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(warm), str(tmp_path / "adapter"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    ids = list(range(5, 25))
    expected = logprobs(adapted.eval(), ids)
    assert (expected - logprobs(AutoModelForCausalLM.from_pretrained(warm), ids)).abs().max() > 1e-3
    torch.testing.assert_close(logprobs(merged, ids), expected, atol=1e-5, rtol=0)
    assert (tmp_path / "merged" / "tokenizer.json").exists() and not (tmp_path / "merged" / "adapter").exists()
    assert main(["export", str(lora_run), str(tmp_path / "v9"), "--step", "9"]) == 2  # one line, naming what exists
    assert re.search(r"^error: step \(9\) has no checkpoint", capsys.readouterr().err, re.M)


def test_merge_of_a_full_weight_run_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(dump_config(load_config(None)))
    assert main(["export", str(run), str(tmp_path / "out"), "--merge"]) == 2
    assert "--merge folds a LoRA adapter into its base" in capsys.readouterr().err


@pytest.mark.slow  # a vLLM engine
def test_merged_export_loads_with_vllm(lora_run, tmp_path):
    from asyncrl.generators.engines.vllm_engine import EngineConfig, VLLMEngine

    out = tmp_path / "merged"
    assert main(["export", str(lora_run), str(out), "--merge"]) == 0
    engine = VLLMEngine(str(out), EngineConfig())
    try:
        assert len(engine.greedy([PROMPT], max_tokens=4)) == 1
        ids = engine.tokenizer.encode("52")
        prompt = engine.tokenizer.encode(PROMPT)
        warm = lora_run / "model" / "warm"
        adapted = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(warm), str(lora_run / "final" / "adapter")
        )
        lp = logprobs(adapted.eval(), prompt + ids)[len(prompt) - 1 : -1]
        expected = lp.gather(1, torch.tensor(ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.from_numpy(engine.score(PROMPT, ids)), expected, atol=1e-4, rtol=0)
    finally:
        engine.close()
