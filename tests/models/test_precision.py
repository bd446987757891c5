"""bf16 where the hardware multiplies it natively, fp32 elsewhere (asyncrl.models.precision)."""

import pytest

from asyncrl.config import load_config
from asyncrl.models import precision
from asyncrl.weights.probe import probe_tolerance

AVX2_ONLY = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse sse2 avx avx2 fma\n\nprocessor\t: 1\n"
SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"


def test_cpu_flags_are_read_from_the_first_processor():
    assert precision.cpu_flags(AVX2_ONLY) == {"fpu", "sse", "sse2", "avx", "avx2", "fma"}
    assert "amx_bf16" in precision.cpu_flags(SAPPHIRE_RAPIDS)
    assert precision.cpu_flags("processor\t: 0\n") == set()


@pytest.mark.parametrize(
    ("native", "trainer", "engine"),
    [(False, "fp32", "float32"), (True, "bf16", "bfloat16")],
)
def test_if_native_dtypes_follow_the_cpu(monkeypatch, native, trainer, engine):
    monkeypatch.setattr(precision, "native_bf16_cpu", lambda: native)
    assert precision.resolve_trainer_dtype("bf16_if_native", cuda=False) == trainer
    assert precision.resolve_engine_dtype("bfloat16_if_native", cuda=False) == engine


def test_explicit_dtypes_are_kept_whatever_the_hardware(monkeypatch):
    monkeypatch.setattr(precision, "native_bf16_cpu", lambda: False)
    assert precision.resolve_trainer_dtype("bf16", cuda=False) == "bf16"
    assert precision.resolve_trainer_dtype("fp32", cuda=False) == "fp32"
    for dtype in ("auto", "float32", "bfloat16", "float16"):
        assert precision.resolve_engine_dtype(dtype, cuda=False) == dtype


def test_this_host_answers_from_its_own_cpuinfo():
    with open("/proc/cpuinfo") as f:
        flags = precision.cpu_flags(f.read())
    assert precision.native_bf16(cuda=False) == bool(flags & {"avx512_bf16", "amx_bf16"})


def test_the_rehearsal_recipe_decides_on_the_hardware_and_the_probe_takes_the_looser_tolerance():
    cfg = load_config("configs/rehearsal_0_5b.yaml")
    assert cfg.engine.dtype == "bfloat16" and cfg.learner.trainer.dtype == "bf16_if_native"
    assert cfg.weights.probe_atol == 0.15
    assert probe_tolerance("bfloat16_if_native", "fp32") == probe_tolerance("float32", "bf16_if_native") == 0.15
