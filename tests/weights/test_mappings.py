"""Mappings of shared-memory files kept across versions: reused for recycled files, released
once no recent version uses them, and never showing stale bytes."""

import os

import pytest
import torch

from asyncrl.weights.buckets import state_dict_buckets
from asyncrl.weights.mappings import MappingCache
from asyncrl.weights.shm import ShmWeightPublisher, ShmWeightSubscriber
from tests.waits import receive_version, wait_until
from tests.weights.test_transports import _state


def _file(path, data: bytes):
    path.write_bytes(data)
    return path


def test_a_file_mapped_again_is_the_same_mapping_and_shows_what_it_holds_now(tmp_path):
    cache = MappingCache(keep=2)
    f = _file(tmp_path / "b0", b"a" * 4096)
    first = cache.map(f, 4096, version=1)
    cache.settle(1)
    moved = tmp_path / "renamed"
    os.replace(f, moved)  # the learner renames a version's folder into place
    with open(moved, "r+b") as w:
        w.write(b"b" * 4096)  # and writes the next version into the same file
    again = cache.map(moved, 4096, version=2)
    assert again is first and cache.reused == 1
    assert again[:4] == b"bbbb"


def test_another_file_or_size_gets_its_own_mapping(tmp_path):
    cache = MappingCache()
    a = cache.map(_file(tmp_path / "a", b"x" * 8192), 8192, version=1)
    b = cache.map(_file(tmp_path / "b", b"x" * 8192), 8192, version=1)
    shorter = cache.map(tmp_path / "a", 4096, version=2)
    assert a is not b and shorter is not a and len(shorter) == 4096 and cache.reused == 0


def test_mappings_no_recent_version_uses_are_released(tmp_path):
    cache = MappingCache(keep=2)
    files = [_file(tmp_path / f"f{i}", b"z" * 4096) for i in range(4)]
    for version, f in enumerate(files, start=1):  # each version in a file of its own
        cache.map(f, 4096, version)
        cache.settle(version)
        assert len(cache) == min(version, 2)
    cache.map(files[3], 4096, version=5)  # a newer version being mapped keeps its file
    cache.settle(4)
    assert len(cache) == 2
    cache.clear()
    assert len(cache) == 0


def test_a_gone_file_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        MappingCache().map(tmp_path / "missing", 16, version=1)


def test_keep_must_be_positive():
    with pytest.raises(ValueError, match=r"keep \(0\) must be >= 1"):
        MappingCache(keep=0)


def test_a_subscriber_reads_recycled_files_through_its_kept_mappings():
    pub = ShmWeightPublisher("tcp://127.0.0.1:0", max_versions=2)
    sub = ShmWeightSubscriber(pub.address, name="g0")
    for version in range(1, 6):
        sd = _state(seed=version)
        pub.publish(state_dict_buckets(sd, 64 << 10), version)
        update = receive_version(sub, pub, served=version - 1)
        got = dict(update.tensors)
        assert update.version == version
        for name, t in sd.items():
            assert torch.equal(got[name], t), (version, name)
        del got
        update.done()
        wait_until(lambda v=version: pub.acked.get("g0") == v, f"g0's ack of version {version}", tick=pub.announce)
    # From the third version on the learner writes into the files of the version before last,
    # and the subscriber maps them no more: two versions' files are mapped, no others.
    assert sub._maps.reused >= 3 * 3
    files_per_version = len(pub.announcer.latest["buckets"])
    assert len(sub._maps) == 2 * files_per_version
    pub.close()
    sub.close()
