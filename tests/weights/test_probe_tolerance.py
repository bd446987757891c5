import pytest

from asyncrl.config import load_config
from asyncrl.weights.probe import probe_tolerance


def test_tolerance_follows_the_coarser_dtype():
    assert probe_tolerance("float32", "fp32") == 1e-3
    assert probe_tolerance("float16", "fp32") == 2e-2
    assert probe_tolerance("bfloat16", "bf16") == 0.15
    assert probe_tolerance("float32", "bf16") == 0.15
    assert probe_tolerance("auto", "fp32") == 0.15  # the model's own dtype: taken as bfloat16


def test_an_unknown_dtype_is_named():
    with pytest.raises(ValueError, match=r"dtype \('int8'\) must be one of"):
        probe_tolerance("int8", "fp32")


def test_the_run_config_resolves_it_unless_given():
    assert load_config(None).weights.probe_atol == 1e-3  # float32 engine and learner
    assert load_config("configs/grpo_gsm8k.yaml").weights.probe_atol == 0.15  # bfloat16 both sides
    assert load_config("configs/grpo_gsm8k.yaml", ["weights.probe_atol=0.2"]).weights.probe_atol == 0.2
    bf16 = load_config(None, ["engine.dtype=bfloat16"])
    assert bf16.weights.probe_atol == 0.15
    # the resolved value is what the run writes and every process reads back
    import yaml

    from asyncrl.config import RunConfig, dump_config

    assert RunConfig(**yaml.safe_load(dump_config(bf16))).weights.probe_atol == 0.15


def test_weights_cast_for_publication_must_be_the_engines_dtype():
    with pytest.raises(ValueError, match=r"weights.dtype \(bfloat16\) must be model or the engine's dtype \(engine.dtype float32\)"):
        load_config("configs/demo.yaml", ["weights.dtype=bfloat16"])
    cfg = load_config("configs/demo.yaml", ["weights.dtype=bfloat16", "engine.dtype=bfloat16"])
    assert cfg.weights.dtype == "bfloat16"
