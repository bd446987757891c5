"""The environment every component is started with."""

import tempfile
from pathlib import Path

from asyncrl.controller.preparation import ONEDNN_PRIMITIVE_CACHE, TMP_PATH_MAX, child_env, remove_short_tmp


def test_children_get_a_bounded_onednn_primitive_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    env = child_env(tmp_path)
    assert env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(ONEDNN_PRIMITIVE_CACHE)
    assert 0 < ONEDNN_PRIMITIVE_CACHE < 1024  # below oneDNN's own default, or it bounds nothing


def test_the_operators_onednn_setting_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16")
    assert child_env(tmp_path)["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "16"


def test_a_long_run_path_gets_a_short_temp_dir_that_is_removed_after(tmp_path):
    run_dir = tmp_path / ("r" * 80)
    tmp = Path(child_env(run_dir)["TMPDIR"])
    assert len(str(tmp)) <= TMP_PATH_MAX and tmp.is_dir() and not tmp.is_relative_to(run_dir)
    (tmp / "engine.sock").write_text("")
    remove_short_tmp(run_dir)
    assert not tmp.exists()


def test_a_temp_dir_inside_the_run_stays_with_the_run():
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="run-") as short:  # pytest's own paths may be too long
        run_dir = Path(short)
        tmp = Path(child_env(run_dir)["TMPDIR"])
        assert tmp == run_dir / "tmp"
        remove_short_tmp(run_dir)
        assert tmp.is_dir()
