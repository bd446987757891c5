import pytest
import torch

from asyncrl.weights.buckets import (
    PARALLEL_MIN_BYTES,
    Digest,
    checksum,
    device_checksum,
    iter_buckets,
    layout,
    pack_into,
    plan_buckets,
    state_dict_buckets,
    unpack,
    verify,
)
from asyncrl.weights.update import WeightSyncError


def _named():
    g = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(3, 5, generator=g)),
        ("b", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("c", torch.arange(4, dtype=torch.int64)),
        ("d", torch.randn(2, 2, generator=g).t()),  # not contiguous
    ]


def test_pack_unpack_round_trip_is_bit_identical():
    named = _named()
    specs, size = layout(named)
    assert all(s.offset % 64 == 0 for s in specs)
    buf = torch.empty(size, dtype=torch.uint8)
    crc = pack_into(named, specs, buf)
    assert crc == checksum(buf.numpy())
    for (name, t), (name2, v) in zip(named, unpack(buf, specs)):
        assert name == name2 and v.dtype == t.dtype and torch.equal(v, t)


@pytest.mark.parametrize("nbytes", [0, 7, PARALLEL_MIN_BYTES * 2 - 8, PARALLEL_MIN_BYTES * 5 + 3])
def test_threaded_sum64_equals_the_single_thread_one(nbytes):
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    one = checksum(data.numpy())
    assert [checksum(data.numpy(), threads=k) for k in (2, 3, 8)] == [one] * 3
    data[nbytes * 2 // 3 :] = 0  # a later slice's change is seen too
    assert nbytes < 16 or checksum(data.numpy(), threads=3) != one


@pytest.mark.gpu
def test_the_device_sum64_equals_the_host_one():
    assert torch.cuda.is_available(), "this test needs CUDA (selected by -m gpu)"
    data = torch.randint(
        0, 256, (PARALLEL_MIN_BYTES * 3,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2)
    )
    assert device_checksum(data.cuda()) == checksum(data.numpy()) == checksum(data.numpy(), threads=2)


def test_checksum_catches_one_flipped_byte():
    named = _named()
    specs, size = layout(named)
    buf = torch.empty(size, dtype=torch.uint8)
    crc = pack_into(named, specs, buf)
    buf[5] ^= 1
    with pytest.raises(WeightSyncError, match="bucket 0: sum64 checksum mismatch"):
        verify(buf.numpy(), crc, "bucket 0")


def test_buckets_stay_under_the_cap_and_keep_every_weight_once():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    model[1].weight = torch.nn.Parameter(torch.randn(4, 16))
    cap = 16 * 16 * 4  # exactly the first weight
    plans = plan_buckets(model, cap)
    assert [[n for n, _ in p] for p in plans] == [["0.weight"], ["0.bias", "1.weight", "1.bias"]]
    got = {n: t for b in iter_buckets(model, cap) for n, t in b}
    assert got.keys() == dict(model.named_parameters()).keys()
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(model, 0)


def test_tied_weights_appear_once():
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    names = [n for b in iter_buckets(model, 1 << 20) for n, _ in b]
    assert names == ["emb.weight"]


def test_state_dict_buckets_cap():
    sd = {f"w{i}": torch.zeros(256) for i in range(5)}  # 1 KiB each
    assert [len(b) for b in state_dict_buckets(sd, 2048)] == [2, 2, 1]


@pytest.mark.parametrize("algo", ["fletcher64", "xxh3", "sum64", "crc32"])
def test_each_checksum_catches_a_zeroed_frame_and_truncation(algo):
    data = torch.arange(1 << 16, dtype=torch.int32).view(torch.uint8).numpy().copy()
    crc = checksum(data, algo)
    bad = data.copy()
    bad[4096:8192] = 0
    assert checksum(bad, algo) != crc
    assert checksum(data[:-8], algo) != crc
    assert checksum(data[:13], algo) == checksum(data[:13].copy(), algo)  # tails that are not whole words
    with pytest.raises(ValueError, match="must be one of"):
        checksum(data, "md5")


def test_all_but_sum64_catch_two_words_swapped():
    data = torch.arange(1 << 12, dtype=torch.int64).view(torch.uint8).numpy().copy()
    swapped = data.copy()
    swapped[0:8], swapped[8:16] = data[8:16], data[0:8]
    assert checksum(swapped, "sum64") == checksum(data, "sum64")  # why the stream uses another
    assert checksum(swapped, "fletcher64") != checksum(data, "fletcher64")
    assert checksum(swapped, "xxh3") != checksum(data, "xxh3")
    assert checksum(swapped, "crc32") != checksum(data, "crc32")


@pytest.mark.parametrize("algo", ["xxh3", "crc32"])
@pytest.mark.parametrize("cut", [1, 8, 1000, 4096])
def test_a_digest_taken_piece_by_piece_equals_the_checksum_of_the_whole(algo, cut):
    data = torch.randint(0, 256, (10_000,), dtype=torch.uint8).numpy()
    digest = Digest(algo)
    for start in range(0, len(data), cut):
        digest.update(data[start : start + cut])
    assert digest.value() == checksum(data, algo)


@pytest.mark.parametrize("algo", ["sum64", "fletcher64"])
def test_a_word_digest_taken_in_8_aligned_pieces_equals_the_checksum_of_the_whole(algo):
    data = torch.randint(0, 256, (4096,), dtype=torch.uint8).numpy()
    digest = Digest(algo)
    for start in range(0, len(data), 1024):  # 8-aligned pieces
        digest.update(data[start : start + 1024])
    assert digest.value() == checksum(data, algo)
    with pytest.raises(ValueError, match=r"checksum algo \('md5'\) must be one of"):
        Digest("md5")
