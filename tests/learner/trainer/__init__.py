"""PolicyTrainer on a tiny model, in modules by topic: the ZeRO stages, the algorithm section, the
updates of a step. Their fixtures sit in ``conftest.py``, their helpers in ``steps.py``.

DeepSpeed runs on the CPU here: the environment is set on importing this package, so before
``conftest.py``, ``steps.py`` or any of the modules imports torch or DeepSpeed.
"""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
