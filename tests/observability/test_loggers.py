"""TensorBoard event files by learner version; W&B when installed, skipped cleanly when not."""

import sys
import types

import msgspec
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from asyncrl.observability.loggers import LoggingConfig, StepLoggers, import_wandb
from asyncrl.observability.step_stats import StepStats

STEP = StepStats(
    version=1, loss=0.5, reward=0.25, tokens=8, staleness_mean=1.0, staleness_max=2, staleness_bound_reason="x"
)


def step(**fields) -> StepStats:
    return msgspec.structs.replace(STEP, **fields)


def scalars(log_dir, tag):
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return [(e.step, round(e.value, 6)) for e in acc.Scalars(tag)]


def test_tensorboard_writes_steps_by_learner_version(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    loggers = StepLoggers(LoggingConfig(), tmp_path, "run")
    loggers.log_step(STEP, {"perf/tokens_per_s": 100.0})
    loggers.log_step(step(version=3, reward=0.75))
    loggers.log_step(step(version=3, reward=0.0))  # a repeat: the axis stays monotonic
    loggers.log_step(step(version=2, reward=0.0))
    loggers.log_summary({"eval_before": 0.1, "eval_after": 0.3, "learner_steps": 3, "reconciles": True})
    loggers.close()
    log_dir = tmp_path / "tensorboard"
    assert scalars(log_dir, "train/reward") == [(1, 0.25), (3, 0.75)]
    assert scalars(log_dir, "perf/tokens_per_s") == [(1, 100.0)]
    assert scalars(log_dir, "eval/exact_match") == [(0, 0.1), (3, 0.3)]
    assert scalars(log_dir, "summary/learner_steps") == [(3, 3.0)]
    tags = EventAccumulator(str(log_dir))
    tags.Reload()
    logged = tags.Tags()["scalars"]
    assert "train/staleness_bound_reason" not in logged and "train/version" not in logged  # text, the x axis
    assert "train/staleness" not in logged and "train/entropy" not in logged  # a list; not measured


def test_wandb_not_installed_is_skipped_on_auto_and_an_error_on_on(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    assert import_wandb("auto") is None and import_wandb("off") is None
    loggers = StepLoggers(LoggingConfig(tensorboard=False), tmp_path, "run")
    assert loggers.loggers == []
    loggers.log_step(STEP)  # nothing configured: a no-op
    loggers.close()
    with pytest.raises(ImportError, match="logging.wandb is 'on' but wandb is not installed"):
        StepLoggers(LoggingConfig(tensorboard=False, wandb="on"), tmp_path, "run")


def test_wandb_when_installed_uses_the_learner_version_as_step_metric(tmp_path, monkeypatch):
    calls = []
    run = types.SimpleNamespace(finish=lambda: calls.append(("finish",)))
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or run
    fake.define_metric = lambda name, **kw: calls.append(("define_metric", name, kw))
    fake.log = lambda data: calls.append(("log", data))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    loggers = StepLoggers(LoggingConfig(tensorboard=False, wandb_mode="offline"), tmp_path, "demo", {"seed": 0})
    loggers.log_step(step(version=4))
    loggers.close()
    init = calls[0][1]
    assert (init["project"], init["name"], init["mode"], init["config"]) == ("asyncrl", "demo", "offline", {"seed": 0})
    assert ("define_metric", "*", {"step_metric": "learner_version"}) in calls
    logged = [c[1] for c in calls if c[0] == "log"]
    figures = {"train/loss": 0.5, "train/reward": 0.25, "train/staleness_mean": 1.0, "train/staleness_max": 2.0}
    figures |= {"train/tokens": 8.0, "train/step_s": 0.0, "train/stale_tokens_masked": 0.0}
    assert logged == [{"learner_version": 4, **figures, "train/stale_samples_masked": 0.0}]
    assert calls[-1] == ("finish",)
