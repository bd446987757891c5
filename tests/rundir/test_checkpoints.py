"""Checkpoint commit: manifest with checksums, atomic rename, latest pointer, pruning, verification."""

import json

import pytest

from asyncrl.rundir.checkpoints import commit, committed, discard_staging, latest_checkpoint, staging_dir, verify


def stage(run_dir, version, payload=b"weights"):
    root = staging_dir(run_dir, version)
    (root / "learner").mkdir(parents=True)
    (root / "learner" / "model.bin").write_bytes(payload)
    (root / "buffer").mkdir()
    (root / "buffer" / "arrays.npz").write_bytes(b"buffer" * 100)
    (root / "dispatcher.json").write_text(json.dumps({"version": version, "dispatched": 8}))
    return root


def test_commit_writes_a_verified_manifest_renames_and_keeps_the_last_n(tmp_path):
    for version in (10, 20, 30):
        stage(tmp_path, version)
        path = commit(tmp_path, version, ["learner", "buffer", "dispatcher.json"], keep_last=2)
        assert path.name == f"v{version:08d}" and not staging_dir(tmp_path, version).exists()
    assert [p.name for p in committed(tmp_path)] == ["v00000020", "v00000030"]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "v00000030"
    manifest = verify(tmp_path / "checkpoints" / "v00000030")
    assert manifest["version"] == 30 and set(manifest["files"]) == {
        "learner/model.bin",
        "buffer/arrays.npz",
        "dispatcher.json",
    }
    assert latest_checkpoint(tmp_path).name == "v00000030"


def test_a_missing_part_refuses_the_commit(tmp_path):
    root = stage(tmp_path, 5)
    (root / "dispatcher.json").unlink()
    with pytest.raises(FileNotFoundError, match="dispatcher.json"):
        commit(tmp_path, 5, ["learner", "buffer", "dispatcher.json"])
    assert committed(tmp_path) == []


def test_a_damaged_checkpoint_is_skipped_for_the_previous_one(tmp_path):
    for version in (1, 2):
        stage(tmp_path, version)
        commit(tmp_path, version, ["learner", "buffer", "dispatcher.json"], keep_last=5)
    (tmp_path / "checkpoints" / "v00000002" / "learner" / "model.bin").write_bytes(b"flipped")
    with pytest.raises(ValueError, match="checksum"):
        verify(tmp_path / "checkpoints" / "v00000002")
    assert latest_checkpoint(tmp_path).name == "v00000001"


def test_uncommitted_parts_are_discarded(tmp_path):
    stage(tmp_path, 3)
    discard_staging(tmp_path)
    assert not staging_dir(tmp_path, 3).exists() and latest_checkpoint(tmp_path) is None
