"""The documentation site builds in strict mode, and its checks catch what would make it untrue.

``mkdocs build --strict`` fails on a broken link or anchor, and the hook (docs/hooks/reference.py)
turns into build failures every config key a page mentions that ``RunConfig`` lacks, every YAML
config block that does not validate, and every repository path or module that does not exist.
"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
HOOKS = REPO_ROOT / "docs" / "hooks"


def load_hook_module(name: str):
    sys.path.insert(0, str(HOOKS))
    try:
        spec = importlib.util.spec_from_file_location(f"docs_hooks_{name}", HOOKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(HOOKS))


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def test_site_builds_strict_with_the_generated_references(site):
    config_page = (site / "reference" / "config" / "index.html").read_text()
    for key in ("total_steps", "max_staleness", "transport", "placement_timeout_s", "engines_per_process"):
        assert f"<code>{key}</code>" in config_page, key  # optional sections (simulation.generator) included
    assert "Learner steps to train" in config_page  # the field's own docstring
    cli_page = (site / "reference" / "cli" / "index.html").read_text()
    for command in ("train", "show-config", "reward-worker", "generator", "bench pipeline", "export", "keys"):
        assert f"asyncrl {command}" in cli_page, command
    assert "configs/demo.yaml" in (site / "reference" / "recipes" / "index.html").read_text()
    assert (site / "benchmarks" / "index.html").is_file()
    metrics_page = (site / "reference" / "metrics" / "index.html").read_text()
    for metric in (
        "asyncrl_auth_failures_total{socket}",
        "asyncrl_buffer_priority",
        "asyncrl_policy_version{component}",
    ):
        assert metric in metrics_page, metric  # every metric of the registry, not only the main ones


@pytest.fixture(scope="module")
def checks():
    return load_hook_module("checks")


@pytest.fixture(scope="module")
def keys():
    return load_hook_module("configref").config_keys()


def test_a_stale_config_key_is_caught(checks, keys):
    page = """
Set `learner.total_steps` and `learner.totl_steps`; `weights.transport: zmq`; `run.seed=3`;
`placement.reward.labels.pool` (a dict: any subkey); `summary.json`, `model.safetensors` are files.

```bash
asyncrl train configs/demo.yaml buffer.max_stalenes=4 run.name=x
```

```text
config error: learner.nope=5: unknown key
```
"""
    assert checks.unknown_config_keys(page, *keys) == ["learner.totl_steps", "buffer.max_stalenes"]


def test_a_yaml_block_that_is_not_a_valid_config_is_caught(checks, keys):
    from asyncrl.config import RunConfig

    sections = {k for k in keys[0] if "." not in k}
    good = "```yaml\nbuffer:\n  max_staleness: 4\n```\n"
    bad = "```yaml\nbuffer:\n  max_staleness: -1\n```\n"
    not_a_config = "```yaml\nscrape_configs: []\n```\n"
    validate = lambda data: RunConfig(**data)  # noqa: E731
    assert checks.invalid_yaml_blocks(good + not_a_config, sections, validate) == []
    assert len(checks.invalid_yaml_blocks(bad, sections, validate)) == 1


def test_a_moved_path_or_module_is_caught(checks):
    page = (
        "`asyncrl/controller/watchdog.py`, `asyncrl.weights.mappings`, `configs/demo.yaml`, `asyncrl.config.RunConfig`"
    )
    assert checks.missing_repo_paths(page, REPO_ROOT) == []
    moved = "`asyncrl/controller/gone.py`, `asyncrl.weights.gone`, `bench/gone.py`"
    moved += "\n\n```text\nasyncrl/dispatcher/process.py  asyncrl/gone/process.py  (configs/demo.yaml)\n```\n"
    assert checks.missing_repo_paths(moved, REPO_ROOT) == [
        "asyncrl/controller/gone.py",
        "asyncrl.weights.gone",
        "bench/gone.py",
        "asyncrl/gone/process.py",
    ]


def test_readme_links_point_at_files():
    readme = (REPO_ROOT / "README.md").read_text()
    targets = [t for t in re.findall(r"\]\(([^)#\s]+)", readme) if "://" not in t]
    assert targets, "the README links into the docs"
    assert [t for t in targets if not (REPO_ROOT / t).exists()] == []
