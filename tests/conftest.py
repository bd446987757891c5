"""Tests marked ``gpu`` need CUDA and run only when selected (``pytest -m gpu``): CI and the
default run have no GPU, and a GPU test selected on a machine without one fails, never skips."""


def pytest_collection_modifyitems(config, items):
    if "gpu" in (config.getoption("markexpr") or ""):
        return  # the marker expression decides
    deselected = [item for item in items if item.get_closest_marker("gpu") is not None]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if item.get_closest_marker("gpu") is None]
