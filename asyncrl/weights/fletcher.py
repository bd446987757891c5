"""Fletcher's checksum over 8-byte words, taken while the bytes are copied to their place.

Why: a subscriber of the weight stream must both check every frame and copy it into its
tensor (a frame is a slice of a tensor, and libzmq frees the frame's memory for the next one).
A hash, then a copy, reads each frame twice and writes the copy through the caches (every
destination line is first read from memory, then written back): on two cores that was half of
a subscriber's CPU time, and raw ZeroMQ pays neither. Here one loop reads each word once, adds
it to the sums and stores it with a non-temporal store (written to memory without first being
read into the cache: the destination is the next GiB of weights, far larger than any cache).
Measured here per GiB received in 1 MiB frames: xxh3 and a copy ~0.11 s, this ~0.05 s.

The checksum is Fletcher's (J. G. Fletcher, "An Arithmetic Checksum for Serial Transmissions",
IEEE Trans. Commun. 30(1), 1982, eq. 1) on 64-bit words with sums mod 2^64: over words
w_1..w_n (little-endian; a piece's tail of fewer than 8 bytes is zero-padded to one word),

    A = sum_i w_i,    B = sum_i A_i = sum_i (n - i + 1) w_i,

where A_i is A after word i. The value is XXH3-64 of the 16 bytes of (A, B), so that any
difference between two (A, B) pairs shows in all 64 bits. A changes with any change to one
word; B with the order of the words (a swap of words w_i != w_j is missed only when
(w_i - w_j)(j - i) = 0 mod 2^64). Fletcher reduces mod 255 or 65535 on bytes or half-words; a
sum mod 2^64 is what one add instruction computes, and words are what the copy moves.

Pieces are summed in order, each starting a word (the stream cuts a tensor into frames of a
multiple of 64 bytes, and the learner sums each tensor whole: the same words either way).
"""

from __future__ import annotations

import numpy as np
import xxhash
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from asyncrl.compiled import jit

_MASK = (1 << 64) - 1


@intrinsic
def _store_streaming(typingctx, array, index, value):
    """``array[index] = value`` with a non-temporal store (LLVM's ``!nontemporal``: ``movnti``
    on x86-64, ``stnp`` on aarch64): the line is written to memory without being read first,
    nor kept in the cache. numba has no such store of its own."""

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]], wraparound=False)
        store = builder.store(args[2], ptr)
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
        return context.get_dummy_value()

    return types.void(array, index, value), codegen


@intrinsic
def _fence(typingctx):
    """A full memory fence: non-temporal stores are weakly ordered, and whoever reads the
    destination next (another thread, the engine) must see them all."""

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


# The sums come back as Python ints; typed anew each call they could be int64, and int64 plus
# uint64 is float64 in numba: every entry fixes them to uint64 (wrapping adds).


@jit
def _sum_words(words, a, b):
    a, b = np.uint64(a), np.uint64(b)
    for i in range(words.shape[0]):
        a += words[i]
        b += a
    return a, b


@jit
def _copy_sum_words(src, dst, a, b):
    a, b = np.uint64(a), np.uint64(b)
    for i in range(src.shape[0]):
        w = src[i]
        a += w
        b += a
        _store_streaming(dst, i, w)
    _fence()
    return a, b


def _bytes(data) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8)


def _words(data: np.ndarray) -> np.ndarray:
    """The 8-byte words of ``data`` (a whole number of them), read-only: numba compiles a kernel
    once per kind of array (dtype, layout, writability; not the alignment in memory, so a frame
    libzmq put at an odd address is read by unaligned loads, which x86-64 and aarch64 allow), and
    a source is then always the same kind, whether libzmq's frame or a tensor."""
    words = data.view(np.uint64)
    words.flags.writeable = False
    return words


def warm() -> None:
    """Compile (or load from numba's cache) both kernels for the arrays they are given, here
    rather than on a version's first frame: ~0.7 s on a fresh install, ~0.2 s once cached."""
    f = Fletcher64()
    f.update(np.zeros(16, dtype=np.uint8))
    f.copy(np.zeros(16, dtype=np.uint8), np.zeros(16, dtype=np.uint8))


class Fletcher64:
    """The checksum of the pieces given to ``update`` or ``copy``, in order (module docstring).

    >>> f = Fletcher64(); f.update(b"weights!"); g = Fletcher64(); g.update(b"!weights")
    >>> f.intdigest() != g.intdigest()
    True
    """

    def __init__(self):
        self.a = np.uint64(0)
        self.b = np.uint64(0)

    def update(self, data) -> None:
        """Add the next piece (anything with the buffer protocol)."""
        src = _bytes(data)
        head = len(src) // 8 * 8
        if head:
            self._set(*_sum_words(_words(src[:head]), self.a, self.b))
        self._tail(src[head:])

    def copy(self, data, out) -> None:
        """Add the next piece while copying it into ``out`` (writable, of the same length)."""
        src, dst = _bytes(data), _bytes(out)
        if len(dst) != len(src):
            raise ValueError(f"copy of {len(src)} bytes into {len(dst)}: the lengths must be equal")
        head = len(src) // 8 * 8
        if head:
            self._set(*_copy_sum_words(_words(src[:head]), dst[:head].view(np.uint64), self.a, self.b))
        dst[head:] = src[head:]
        self._tail(src[head:])

    def _set(self, a, b) -> None:
        self.a, self.b = np.uint64(a), np.uint64(b)

    def _tail(self, rest: np.ndarray) -> None:
        if len(rest):
            word = int.from_bytes(rest.tobytes(), "little")  # zero-padded to 8 bytes
            a = (int(self.a) + word) & _MASK
            self._set(a, (int(self.b) + a) & _MASK)

    def intdigest(self) -> int:
        return xxhash.xxh3_64_intdigest(np.array([self.a, self.b], dtype="<u8").tobytes())
