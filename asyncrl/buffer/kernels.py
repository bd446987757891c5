"""Compiled sum-tree kernels (numba), for trees large enough that numpy's per-level calls and
cache misses dominate a batch.

A numpy descent or update costs ~5 calls per level on k items (~20 levels at 10^6 leaves); the
loops here do the same arithmetic with no call overhead. Both walk the tree *level by level*
over the whole batch (the outer loop is the level, the inner one the k items), like the numpy
code: the k loads of a level are independent, so their cache misses overlap. An item-by-item
walk (each item root to leaf, then the next) is ~4x slower at 10^6 leaves, because each item's
loads wait for the previous one. Measured at 10^6 leaves, k = 256, one core: descent 53 µs
against 130 µs for the plain numpy one; update of 256 leaves 10 µs against ~140 µs.

numba (LLVM, maintained by Anaconda and NVIDIA, wheels for Linux x86-64 and aarch64, on CPU and
GPU nodes alike) is optional: ``available()`` is False without it and the sum tree stays on
numpy. Compilation (~2 s) happens on first use, so only buffers that ask for it (large ones,
``SumTree.KERNEL_MIN_LEAVES``) pay it.
"""

from __future__ import annotations

_kernels = None


def available() -> bool:
    """Whether numba imports (the kernels are compiled on the first call of ``get``)."""
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


def get():
    """(descend, update) compiled, or None without numba."""
    global _kernels
    if _kernels is None:
        if not available():
            return None
        try:
            _kernels = _compile(cache=True)
        except RuntimeError:  # numba finds no writable place for its cache (read-only install)
            _kernels = _compile(cache=False)
    return _kernels


def _compile(cache: bool):
    import numba

    @numba.njit(nogil=True, cache=cache)
    def descend(s, u, pos, levels):  # pragma: no cover - compiled
        """From nodes ``pos`` (k,), ``levels`` levels down: right when u >= the left child's sum."""
        for _ in range(levels):
            for i in range(u.size):
                p = pos[i] << 1
                left = s[p]
                if u[i] >= left:
                    u[i] -= left
                    p += 1
                pos[i] = p
        return pos

    @numba.njit(nogil=True, cache=cache)
    def update(s, pos, values, depth):  # pragma: no cover - compiled
        """Leaves at nodes ``pos`` (k,) set to ``values``, then each level's parents recomputed
        from their children (exact), the batch's level before the next."""
        for i in range(pos.size):
            s[pos[i]] = values[i]
        for level in range(1, depth + 1):
            for i in range(pos.size):
                p = pos[i] >> level
                s[p] = s[2 * p] + s[2 * p + 1]

    return descend, update
