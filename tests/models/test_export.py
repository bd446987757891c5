"""``asyncrl export``: the final model or a published version, loadable by transformers and vLLM."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import re  # noqa: E402
import shutil  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from asyncrl.cli import main  # noqa: E402
from asyncrl.config import RunConfig, dump_config  # noqa: E402
from asyncrl.models.export import export  # noqa: E402
from asyncrl.models.tiny import TinyModelConfig, build_tiny_model  # noqa: E402
from asyncrl.weights.file_writer import write_weights  # noqa: E402


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A finished run's layout: starting model, final model, two published versions."""
    run = tmp_path_factory.mktemp("run")
    (run / "config.yaml").write_text(dump_config(RunConfig()))
    warm = build_tiny_model(TinyModelConfig(), run / "model" / "warm")
    shutil.copytree(warm, run / "final")
    state = AutoModelForCausalLM.from_pretrained(warm).state_dict()
    for version in (2, 4):
        write_weights({k: v + version for k, v in state.items()}, run / "weights", version)
    return run


def test_export_of_a_published_version_loads_with_transformers(run_dir, tmp_path, capsys):
    assert main(["export", str(run_dir), str(tmp_path / "v4"), "--step", "4"]) == 0
    start = AutoModelForCausalLM.from_pretrained(run_dir / "model" / "warm").state_dict()
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "v4").state_dict()
    for name, tensor in start.items():
        torch.testing.assert_close(exported[name], tensor + 4)
    assert (tmp_path / "v4" / "tokenizer.json").exists()
    assert main(["export", str(run_dir), str(tmp_path / "v3"), "--step", "3"]) == 2  # a user's mistake: one line
    assert re.search(r"^error: .*published: \[2, 4\]", capsys.readouterr().err, re.M)
    with pytest.raises(FileExistsError):
        export(run_dir, tmp_path / "v4")


@pytest.mark.slow  # a vLLM engine
def test_export_of_the_final_model_loads_with_vllm(run_dir, tmp_path):
    from asyncrl.generators.engines.vllm_engine import EngineConfig, VLLMEngine

    out = tmp_path / "final"
    assert main(["export", str(run_dir), str(out)]) == 0
    engine = VLLMEngine(str(out), EngineConfig())
    try:
        assert len(engine.greedy(["07+45="], max_tokens=4)) == 1
        ids = engine.tokenizer.encode("52")
        hf = AutoModelForCausalLM.from_pretrained(out)
        prompt = engine.tokenizer.encode("07+45=")
        logits = hf(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.from_numpy(engine.score("07+45=", ids)), expected, atol=1e-4, rtol=0)
    finally:
        engine.close()
