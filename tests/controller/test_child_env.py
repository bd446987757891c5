"""The environment every component is started with."""

from asyncrl.controller.preparation import ONEDNN_PRIMITIVE_CACHE, child_env


def test_children_get_a_bounded_onednn_primitive_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    env = child_env(tmp_path)
    assert env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(ONEDNN_PRIMITIVE_CACHE)
    assert 0 < ONEDNN_PRIMITIVE_CACHE < 1024  # below oneDNN's own default, or it bounds nothing


def test_the_operators_onednn_setting_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16")
    assert child_env(tmp_path)["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "16"
