"""The C heap's free pages handed back to the system between large allocations.

glibc serves a block below its mmap threshold from its heap, and raises that threshold (up to
32 MB) each time it frees a larger mapped block; a freed heap block in the middle of the heap
stays in the process's resident set. Building a model partitioned gathers each module whole,
copies it and frees it beside the partitions that stay, and DeepSpeed's flattening copies
every parameter (or partition) into one buffer and frees the originals: at 0.1-1 B parameters
those blocks are a few MB each, and the holes they leave add up to a large part of the model
(a 0.36 B model at ZeRO-3 over two ranks: 1.0-1.3 GiB per rank held by holes after construction).
``release_freed_memory`` (glibc's ``malloc_trim``) returns them; with another C library it does
nothing.
"""

from __future__ import annotations

import ctypes


def release_freed_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim(0)``)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.malloc_trim(0)
