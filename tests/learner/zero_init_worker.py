"""One learner rank of the ZeRO-3 construction memory test (``test_zero_init.py``).

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p \\
        python -m tests.learner.zero_init_worker MODEL_DIR OUT_DIR MODE WARM_MODEL_DIR

In a fresh process (imports and the process group already paid for, and DeepSpeed's own
ZeRO-3 state built once on WARM_MODEL_DIR, a model of a few kB), it measures the peak of the process's
resident memory above where it stood over one construction, MODE:

- ``partitioned``: the policy at ``zero_stage: 3`` (``partitioned_load.build_causal_lm``);
- ``value_model``: the critic's value model at ZeRO-3 (``critic.build_value_model``);
- ``full``: the old way, the whole fp32 model on the rank (``from_pretrained``);

and writes it, with the rank's share of the parameters and the largest module's bytes, to
``OUT_DIR/MODE.rank{r}.json``. The peak is the kernel's high-water mark of the resident set
(``VmHWM``), reset before the construction by writing 5 to ``/proc/self/clear_refs``. The
test runs it with a fixed ``MALLOC_MMAP_THRESHOLD_``: glibc otherwise raises its threshold
after the first large free and serves later blocks of a few MB from its heap, where freed
memory stays resident, and the peak would measure the allocator's history, not the model.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

torch.set_num_threads(1)


def status_bytes(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def peak_above_now(build):
    """``(result of build(), peak resident bytes above the resident set before it)``."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts from the current RSS
    before = status_bytes("VmRSS")
    result = build()
    return result, status_bytes("VmHWM") - before


def largest_module_bytes(model: torch.nn.Module) -> int:
    """Bytes (full, fp32) of the module whose own parameters are the largest: what a rank holds
    whole at once while the model is loaded."""
    return max(
        sum(int(getattr(p, "ds_numel", p.numel())) * 4 for p in m.parameters(recurse=False)) for m in model.modules()
    )


def main(argv: list[str]) -> int:
    from transformers import AutoModelForCausalLM

    from asyncrl.learner.config import TrainerConfig
    from asyncrl.learner.critic import build_value_model
    from asyncrl.learner.deepspeed_setup import init_learner_group
    from asyncrl.learner.partitioned_load import build_causal_lm

    model_dir, out_dir, mode, warm = Path(argv[0]), Path(argv[1]), argv[2], Path(argv[3])
    init_learner_group(120.0)
    rank = torch.distributed.get_rank()
    cfg = TrainerConfig(zero_stage=3)
    # Once, unmeasured, on a model of a few kB (``warm``): the first zero.Init and gather build
    # DeepSpeed's own state (its groups, its parameter registry), the process's, not the model's.
    build_causal_lm(warm, cfg)
    build_value_model(warm, cfg)
    figures = {"rank": rank, "world": torch.distributed.get_world_size(), "mode": mode}
    if mode == "full":
        _, figures["peak"] = peak_above_now(
            lambda: AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        )
    else:
        build = build_causal_lm if mode == "partitioned" else build_value_model
        model, figures["peak"] = peak_above_now(lambda: build(model_dir, cfg))
        figures["share"] = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in model.parameters())
        figures["total"] = sum(p.ds_numel * 4 for p in model.parameters())
        figures["largest_module"] = largest_module_bytes(model)
    (out_dir / f"{mode}.rank{rank}.json").write_text(json.dumps(figures))
    torch.distributed.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
