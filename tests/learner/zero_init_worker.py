"""One learner rank of the ZeRO-3 construction memory test (``test_zero_init.py``).

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p \\
        python -m tests.learner.zero_init_worker MODEL_DIR OUT_DIR

In a fresh process (imports and the process group already paid for), it measures the peak of
the process's resident memory above where it stood, over each construction in turn:

- ``partitioned``: the policy at ``zero_stage: 3`` (``partitioned_load.build_causal_lm``);
- ``value_model``: the critic's value model at ZeRO-3 (``critic.build_value_model``);
- ``full``: the old way, the whole fp32 model on the rank (``from_pretrained``);

and writes them, with the rank's share of the parameters and the largest module's bytes, to
``OUT_DIR/rank{r}.json``. The peak is the kernel's high-water mark of the resident set
(``VmHWM``), reset before each construction by writing 5 to ``/proc/self/clear_refs``.
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

    model_dir, out_dir = Path(argv[0]), Path(argv[1])
    init_learner_group(120.0)
    cfg = TrainerConfig(zero_stage=3)
    # Once, unmeasured: the first zero.Init and gather build DeepSpeed's own state (the comm
    # groups, the parameter registry), which are the process's, not the model's.
    del_me = build_causal_lm(model_dir, cfg)
    del del_me
    model, partitioned = peak_above_now(lambda: build_causal_lm(model_dir, cfg))
    share = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in model.parameters())
    total = sum(p.ds_numel * 4 for p in model.parameters())
    largest = largest_module_bytes(model)
    del model
    value, value_model = peak_above_now(lambda: build_value_model(model_dir, cfg))
    value_share = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in value.parameters())
    del value
    full_model, full = peak_above_now(lambda: AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    del full_model
    rank = torch.distributed.get_rank()
    figures = {
        "rank": rank,
        "world": torch.distributed.get_world_size(),
        "partitioned": partitioned,
        "value_model": value_model,
        "full": full,
        "share": share,
        "value_share": value_share,
        "total": total,
        "largest_module": largest,
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(figures))
    torch.distributed.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
