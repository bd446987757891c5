"""Fletcher-64 against its formula, summed alone or fused with a copy, whatever the pieces'
alignment in memory."""

import numpy as np
import pytest
import xxhash

from asyncrl.weights.buckets import Digest, checksum
from asyncrl.weights.fletcher import Fletcher64

MASK = (1 << 64) - 1


def reference(pieces: list[bytes]) -> int:
    """The module docstring's formula, a word at a time in Python: A = sum w_i, B = sum A_i
    (mod 2^64), a piece's tail zero-padded to a word; the value is XXH3-64 of (A, B)."""
    a = b = 0
    for piece in pieces:
        for i in range(0, len(piece), 8):
            a = (a + int.from_bytes(piece[i : i + 8], "little")) & MASK
            b = (b + a) & MASK
    return xxhash.xxh3_64_intdigest(a.to_bytes(8, "little") + b.to_bytes(8, "little"))


def pieces_of(data: bytes, cut: int) -> list[bytes]:
    return [data[i : i + cut] for i in range(0, len(data), cut)]


@pytest.mark.parametrize("size, cut", [(0, 8), (5, 8), (4096, 4096), (10_003, 1024), (10_003, 64)])
def test_update_and_copy_equal_the_formula_piece_by_piece(size, cut):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    summed, copied = Fletcher64(), Fletcher64()
    out = bytearray(size)
    for start in range(0, size, cut):
        piece = data[start : start + cut]
        summed.update(piece)
        copied.copy(piece, memoryview(out)[start : start + len(piece)])
    assert summed.intdigest() == copied.intdigest() == reference(pieces_of(data, cut))
    assert bytes(out) == data


@pytest.mark.parametrize("shift", range(8))
def test_a_source_at_any_address_is_summed_and_copied_alike(shift):
    # libzmq puts a small frame anywhere in its buffer: the words need not be 8-aligned in memory
    data = np.random.default_rng(0).integers(0, 256, 4099, dtype=np.uint8).tobytes()
    backing = bytearray(len(data) + 8)
    src = memoryview(backing)[shift : shift + len(data)]
    src[:] = data
    digest, out = Digest("fletcher64"), bytearray(len(data))
    digest.copy(src, out)
    assert bytes(out) == data
    assert digest.value() == checksum(data, "fletcher64") == reference([data])


def test_it_sees_order_position_and_each_bit():
    words = np.arange(1, 513, dtype=np.uint64)
    base = checksum(words.tobytes(), "fletcher64")
    swapped = words.copy()
    swapped[[3, 400]] = swapped[[400, 3]]
    shifted = np.roll(words, 1)
    assert checksum(swapped.tobytes(), "fletcher64") != base
    assert checksum(shifted.tobytes(), "fletcher64") != base
    for bit in (0, 31, 63):
        flipped = words.copy()
        flipped[7] ^= np.uint64(1 << bit)
        assert checksum(flipped.tobytes(), "fletcher64") != base, bit


def test_copy_refuses_a_destination_of_another_length():
    with pytest.raises(ValueError, match="copy of 16 bytes into 8"):
        Fletcher64().copy(b"\0" * 16, bytearray(8))
