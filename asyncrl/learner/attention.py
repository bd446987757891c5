"""Attention implementations the learner's models can run (``learner.trainer.attn_implementation``).

The value is Hugging Face's ``attn_implementation`` (transformers 5.x), passed to every model the
learner loads: the policy, the critic's value model, the KL reference (colocated or in its own
process) and the offline (SFT/DPO) learner's model. ``check_attn_implementation`` refuses, when
the config is read, a name transformers does not know and one whose package is not installed
(the error names the install), rather than letting each process fail at load time.

| name | needs | packed rows (``asyncrl.learner.packing``) |
| --- | --- | --- |
| ``sdpa`` (default) | torch | as long as the step's longest sequence |
| ``eager`` | torch | as long as the step's longest sequence |
| ``flex_attention`` | torch >= 2.5 | as long as the step's longest sequence |
| ``flash_attention_2`` | ``flash-attn`` (or ``kernels``) | one row of ``micro_batch_tokens`` |
| ``flash_attention_3`` | ``flash-attn-3`` (or ``kernels``) | one row of ``micro_batch_tokens`` |
| ``flash_attention_4`` | ``flash-attn-4`` (or ``kernels``) | one row of ``micro_batch_tokens`` |
| ``org/repo[@rev][:fn]`` | ``kernels`` (a Hugging Face Hub kernel) | one row if ``flash`` is in the name |

Every one of them keeps attention within each packed sequence: given ``position_ids`` that
restart at 0 and no attention mask, transformers 5.19 (``masking_utils.find_packed_sequence_indices``)
builds a block-diagonal causal mask for sdpa, eager and flex, and flash-attention's
variable-length kernel takes the sequence boundaries from the same position ids. Dense kernels
(sdpa, eager; flex where its block mask is not sparse) pay for the whole (row x row) score
matrix, so their rows are kept short; flash-attention costs the sum of the sequences' squares,
so a micro batch there is one long row, as verl and OpenRLHF pack (``varlen_attention``).

transformers falls back to the ``kernels`` package for a flash-attention version whose own
package is missing (it then fetches the kernel from the Hub on first use); so do these checks.
This module imports only the standard library: the config imports it.
"""

from __future__ import annotations

import re
from importlib import metadata

DENSE = ("sdpa", "eager", "flex_attention")
"""Implementations that need nothing beyond torch (flex_attention: torch >= 2.5, pinned here)."""

FLASH_PACKAGES: dict[str, tuple[str, str]] = {
    "flash_attention_2": ("flash-attn", "pip install flash-attn --no-build-isolation"),
    "flash_attention_3": (
        "flash-attn-3",
        "pip install ./hopper in a clone of github.com/Dao-AILab/flash-attention (no PyPI wheel)",
    ),
    "flash_attention_4": ("flash-attn-4", "pip install flash-attn-4"),
}
"""Flash-attention versions: (the distribution transformers looks for, how to install it)."""

HUB_KERNEL = re.compile(r"^[^/:]+/[^/:]+(?:@[^/:]+)?(?::[^/:]+)?$")
"""A kernel on the Hugging Face Hub, ``org/repo[@revision][:function]`` (transformers' ``is_kernel``)."""


def installed(distribution: str) -> bool:
    """Whether a distribution of that name is installed in this environment."""
    try:
        metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


def check_attn_implementation(name: str) -> str:
    """``name`` if transformers knows it and what it needs is installed, else a ValueError
    naming the value, the rule and the install."""
    field = "learner.trainer.attn_implementation"
    if name in DENSE:
        return name
    if name in FLASH_PACKAGES:
        package, install = FLASH_PACKAGES[name]
        if installed(package) or installed("kernels"):
            return name
        raise ValueError(
            f"{field} ({name}) needs the {package} package, which is not installed here: {install} "
            "(or install `kernels`, from which transformers fetches the kernel from the Hugging Face Hub); "
            "sdpa needs nothing"
        )
    if HUB_KERNEL.match(name):
        if installed("kernels"):
            return name
        raise ValueError(
            f"{field} ({name}) is a Hugging Face Hub kernel and needs the kernels package, "
            "which is not installed here: pip install kernels"
        )
    known = ", ".join((*DENSE, *FLASH_PACKAGES))
    raise ValueError(f"{field} ({name}) must be one of {known}, or a Hub kernel org/repo[@revision][:function]")


def varlen_attention(name: str) -> bool:
    """Whether the kernel's cost is the sum of the packed sequences' squares (flash-attention's
    variable-length kernel), so a packed micro batch is one row of ``micro_batch_tokens``."""
    return "flash" in name
