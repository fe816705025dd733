"""The manifest of a checkpoint directory (part of the format, checkpoint/format.py): every file with its size and
checksum, written last.

A save writes its files into ``iter_XXXXXXX.partial``, then this manifest (``manifest.json``), then renames the
directory; so a checkpoint directory with a manifest whose files all match it is complete, and anything else is
not. Checksumming and verifying are split over the ranks (each rank reads the ``__<rank>_<n>.distcp`` files it
wrote, rank 0 the rest) and the findings gathered, so every rank reaches the same verdict.

Manifest (JSON)::

    {"format": "megatron-glm5-checkpoint-manifest", "version": 1, "iteration": 6, "checksum": "sha256",
     "created": "2026-11-30T14:04:28Z", "world_size": 1, "layout": {...}, "args": {...},
     "files": {"__0_0.distcp": {"size": 5558322, "sha256": "9f2c..."}, ".metadata": {...}, ...}}
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import zlib
from typing import Dict, List, Optional

import torch.distributed as dist

MANIFEST = "manifest.json"
FORMAT = "megatron-glm5-checkpoint-manifest"
VERSION = 1
CHECKSUMS = ("sha256", "crc32", "none")
_CHUNK = 8 << 20
_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp$")

def _rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(obj) -> list:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def file_checksum(path: str, algorithm: str, sync: bool = False) -> Optional[str]:
    """Checksum of a file's bytes (None for algorithm "none"); ``sync`` also flushes it to stable storage."""
    with open(path, "rb") as f:
        if sync:
            os.fsync(f.fileno())
        if algorithm == "none":
            return None
        if algorithm == "sha256":
            h = hashlib.sha256()
            for block in iter(lambda: f.read(_CHUNK), b""):
                h.update(block)
            return h.hexdigest()
        if algorithm == "crc32":
            crc = 0
            for block in iter(lambda: f.read(_CHUNK), b""):
                crc = zlib.crc32(block, crc)
            return f"{crc:08x}"
    raise ValueError(f"unknown checksum {algorithm!r} (choose from {', '.join(CHECKSUMS)})")


def _owner(name: str, world: int) -> int:
    """The rank that checksums / verifies a file: the writer of a ``__<rank>_<n>.distcp`` file, else rank 0."""
    m = _RANK_FILE.search(name)
    return int(m.group(1)) % world if m else 0


def _list_files(directory: str) -> List[str]:
    names = []
    for base, _, files in os.walk(directory):
        for f in files:
            names.append(os.path.relpath(os.path.join(base, f), directory))
    return sorted(n for n in names if n != MANIFEST and not n.startswith(MANIFEST + "."))


def _jsonable(value):
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


def write_manifest(directory: str, iteration: int, algorithm: str, layout: dict, args: dict) -> dict:
    """Collective: checksum every file of ``directory`` (each rank its share, fsynced) and have rank 0 write the
    manifest (write aside, fsync, rename). Call after every rank has finished writing its files."""
    rank, world = _rank_world()
    names = _list_files(directory) if rank == 0 else None
    if world > 1:
        holder = [names]
        dist.broadcast_object_list(holder, src=0)
        names = holder[0]
    mine = {}
    for name in names:
        if _owner(name, world) == rank:
            path = os.path.join(directory, name)
            mine[name] = {"size": os.path.getsize(path), algorithm: file_checksum(path, algorithm, sync=True)}
    files = {}
    for part in _gather(mine):
        files.update(part)
    manifest = {
        "format": FORMAT, "version": VERSION, "iteration": iteration, "checksum": algorithm,
        "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "world_size": world, "layout": layout, "args": {k: _jsonable(v) for k, v in sorted(args.items())},
        "files": {n: {k: v for k, v in files[n].items() if v is not None} for n in sorted(files)},
    }
    if rank == 0:
        tmp = os.path.join(directory, MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(directory, MANIFEST))
        fsync_dir(directory)
    if dist.is_initialized():
        dist.barrier()
    return manifest


def fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_manifest(directory: str) -> dict:
    """The manifest of a checkpoint directory; raises ValueError (saying what is wrong) when absent or unreadable."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        raise ValueError(f"no {MANIFEST} (the save did not finish)")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{MANIFEST} unreadable ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise ValueError(f"{MANIFEST} is not a megatron-glm5 checkpoint manifest")
    return manifest


def _check_file(directory: str, name: str, entry: dict, algorithm: str) -> Optional[str]:
    path = os.path.join(directory, name)
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return f"{name}: missing"
    except OSError as e:
        return f"{name}: unreadable ({e.strerror or e})"
    if size != entry.get("size"):
        return f"{name}: {size} bytes, the manifest says {entry.get('size')} (truncated or overwritten)"
    if algorithm != "none" and algorithm in entry:
        try:
            digest = file_checksum(path, algorithm)
        except OSError as e:
            return f"{name}: unreadable ({e.strerror or e})"
        if digest != entry[algorithm]:
            return f"{name}: {algorithm} mismatch (corrupted)"
    return None


def verify(directory: str) -> List[str]:
    """Collective: what is wrong with a checkpoint directory (empty list: complete and intact). Each rank reads
    its share of the files; every rank returns the same list."""
    rank, world = _rank_world()
    problems: List[str] = []
    manifest = None
    try:
        manifest = read_manifest(directory)
    except ValueError as e:
        problems.append(str(e))
    if manifest is not None:
        algorithm = manifest.get("checksum", "none")
        for name, entry in sorted(manifest["files"].items()):
            if _owner(name, world) == rank:
                problem = _check_file(directory, name, entry, algorithm)
                if problem:
                    problems.append(problem)
    merged: Dict[str, None] = {}
    for part in _gather(problems):
        merged.update(dict.fromkeys(part))
    return list(merged)
