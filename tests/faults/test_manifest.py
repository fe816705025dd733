"""The checkpoint manifest, checkpoint selection on load and --keep-last retention, on hand-made directories
(no training: milliseconds)."""
from __future__ import annotations

import errno
import json
import logging

import pytest

from megatron_glm5.checkpoint import manifest as cm
from megatron_glm5.training import checkpointing as ck


def _checkpoint(root, iteration, algorithm="sha256", payload=b"x" * 1000):
    d = root / f"iter_{iteration:07d}"
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(payload + bytes([iteration]))
    (d / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    cm.write_manifest(str(d), iteration, algorithm, {"tp": 1}, {"lr": 0.1, "obj": object()})
    return d


def _flip(path, at=10):
    data = bytearray(path.read_bytes())
    data[at] ^= 1
    path.write_bytes(bytes(data))


def test_manifest_lists_every_file_with_size_and_checksum(tmp_path):
    import hashlib
    d = _checkpoint(tmp_path, 2)
    m = json.loads((d / "manifest.json").read_text())
    assert m["format"] == cm.FORMAT and m["iteration"] == 2 and m["checksum"] == "sha256"
    assert m["layout"] == {"tp": 1} and m["args"]["lr"] == 0.1 and m["args"]["obj"].startswith("<object")
    data = (d / "__0_0.distcp").read_bytes()
    assert m["files"]["__0_0.distcp"] == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert sorted(m["files"]) == ["__0_0.distcp", "metadata.json"]
    assert cm.verify(str(d)) == []


@pytest.mark.parametrize("algorithm", ["sha256", "crc32"])
def test_verify_names_the_file_and_the_problem(tmp_path, algorithm):
    d = _checkpoint(tmp_path, 2, algorithm)
    _flip(d / "__0_0.distcp")
    assert cm.verify(str(d)) == [f"__0_0.distcp: {algorithm} mismatch (corrupted)"]
    with open(d / "__0_0.distcp", "r+b") as f:
        f.truncate(10)
    assert cm.verify(str(d)) == ["__0_0.distcp: 10 bytes, the manifest says 1001 (truncated or overwritten)"]
    (d / "metadata.json").unlink()
    assert "metadata.json: missing" in cm.verify(str(d))


def test_checksum_none_checks_sizes_only(tmp_path):
    d = _checkpoint(tmp_path, 2, "none")
    _flip(d / "__0_0.distcp")
    assert cm.verify(str(d)) == []  # documented: sizes only
    (d / "__0_0.distcp").write_bytes(b"short")
    assert cm.verify(str(d)) and "5 bytes" in cm.verify(str(d))[0]


def test_missing_or_garbled_manifest(tmp_path):
    d = _checkpoint(tmp_path, 2)
    (d / "manifest.json").write_text('{"format": "megatron-glm5-checkpoint-manifest", "files": ')
    assert cm.verify(str(d))[0].startswith("manifest.json unreadable")
    (d / "manifest.json").unlink()
    assert cm.verify(str(d)) == ["no manifest.json (the save did not finish)"]


def test_load_picks_newest_good_checkpoint_and_warns(tmp_path, caplog):
    for it in (2, 4, 6):
        _checkpoint(tmp_path, it)
    (tmp_path / "iter_0000008.partial").mkdir()
    (tmp_path / ck.LATEST).write_text("6")
    _flip(tmp_path / "iter_0000006" / "__0_0.distcp")
    with caplog.at_level(logging.WARNING, logger="megatron_glm5.checkpoint"):
        path, it = ck.resolve_load_dir(str(tmp_path))
    assert (path, it) == (str(tmp_path / "iter_0000004"), 4)
    text = caplog.text
    assert "skipping checkpoint" in text and "iter_0000006: __0_0.distcp: sha256 mismatch" in text
    assert "iter_0000008.partial" in text and "resuming from" in text


def test_load_uses_a_complete_checkpoint_newer_than_the_pointer(tmp_path):
    _checkpoint(tmp_path, 2)
    _checkpoint(tmp_path, 4)  # renamed, but the run died before moving the pointer
    (tmp_path / ck.LATEST).write_text("2")
    assert ck.resolve_load_dir(str(tmp_path)) == (str(tmp_path / "iter_0000004"), 4)


def test_no_good_checkpoint_is_one_error_listing_each(tmp_path):
    for it in (2, 4):
        _flip(_checkpoint(tmp_path, it) / "__0_0.distcp")
    with pytest.raises(ck.CheckpointMismatch) as e:
        ck.resolve_load_dir(str(tmp_path))
    msg = str(e.value)
    assert msg.startswith(f"--load {tmp_path}: no usable checkpoint") and "\n" not in msg
    assert "iter_0000004: __0_0.distcp: sha256 mismatch" in msg and "iter_0000002: __0_0.distcp" in msg


def test_only_interrupted_saves_is_an_error(tmp_path):
    (tmp_path / "iter_0000002.partial").mkdir()
    with pytest.raises(ck.CheckpointMismatch, match="only interrupted saves"):
        ck.resolve_load_dir(str(tmp_path))


def test_damaged_single_directory_is_refused(tmp_path):
    d = _checkpoint(tmp_path, 2)
    _flip(d / "__0_0.distcp")
    with pytest.raises(ck.CheckpointMismatch, match="damaged checkpoint: __0_0.distcp: sha256 mismatch"):
        ck.resolve_load_dir(str(d))


def test_keep_last_keeps_the_newest_good_checkpoint(tmp_path):
    _checkpoint(tmp_path, 2)
    _flip(_checkpoint(tmp_path, 4) / "__0_0.distcp")
    (tmp_path / "iter_0000003.partial").mkdir()  # a stale interrupted save
    ck.apply_retention(str(tmp_path), 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000002", "iter_0000004"]
    _checkpoint(tmp_path, 6)
    ck.apply_retention(str(tmp_path), 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000006"]


def test_keep_last_deletes_nothing_when_nothing_verifies(tmp_path):
    for it in (2, 4):
        _flip(_checkpoint(tmp_path, it) / "__0_0.distcp")
    ck.apply_retention(str(tmp_path), 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000002", "iter_0000004"]


def test_write_error_names_directory_and_cause(tmp_path):
    _checkpoint(tmp_path, 2)
    partial = str(tmp_path / "iter_0000004.partial")
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("worker failed") from inner
    except RuntimeError as outer:
        err = ck._write_error(outer, partial, str(tmp_path))
    msg = str(err)
    assert isinstance(err, ck.CheckpointWriteError)
    assert msg.startswith(f"--save {tmp_path}: writing checkpoint {partial} failed ([Errno {errno.ENOSPC}] ")
    assert "free space there:" in msg and f"{tmp_path / 'iter_0000002'} is untouched" in msg


def test_write_error_without_the_os_error_still_says_the_disk_is_full(tmp_path, monkeypatch):
    """megatron-core's writer reports a worker's ENOSPC as 'Worker failure ...' with no OS error attached: the
    message then rests on the free space (nearly none: 'the disk is full') and the bytes written before it."""
    import collections
    import shutil

    partial = tmp_path / "iter_0000004.partial"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"x" * (3 << 20))
    written = ck._dir_bytes(str(partial))
    assert written == 3 << 20
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(100 << 30, (100 << 30) - (5 << 20), 5 << 20))
    msg = str(ck._write_error(RuntimeError("Worker failure: RuntimeError"), str(partial), str(tmp_path), written))
    assert "Worker failure: RuntimeError); the disk is full (free space there: 0.0 GiB, 0.0 GiB of it" in msg
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(100 << 30, 50 << 30, 50 << 30))
    msg = str(ck._write_error(RuntimeError("Worker failure: RuntimeError"), str(partial), str(tmp_path), 7 << 30))
    assert "disk full or a file-size/quota limit? (free space there: 50.0 GiB, 7.0 GiB of it written" in msg
