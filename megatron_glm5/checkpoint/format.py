"""The on-disk format of megatron-glm5 checkpoints, for the trainer and the converters alike.

A checkpoint is a megatron-core ``torch_dist`` directory (PyTorch Distributed Checkpoint files, read and written
by megatron-core's ``dist_checkpointing`` in training and by ``conversion/torch_dist_stream.py`` in the
converters) plus what this project adds around it::

    ROOT/iter_0000100/                      one checkpoint of a --save root (``iteration_dir``)
    ROOT/iter_0000100.partial/              a save in progress (renamed to iter_XXXXXXX when complete)
    ROOT/iter_0000100/manifest.json         every file's size and checksum (checkpoint/manifest.py)
    ROOT/latest_checkpointed_iteration.txt  the ``latest`` pointer: the iteration number, nothing else
    DIR/.metadata                           DCP's index of the stored chunks (every torch_dist directory)
    DIR/metadata.json                       megatron-core's backend record (``MEGATRON_METADATA``)

A converted checkpoint is one such directory on its own (no root, no pointer, no manifest). The common state
(megatron-core's ``common_state`` object, ``COMMON_KEY``; ``common.pt`` in older megatron-core) holds, under
``"glm5"``, the :class:`ModelRecord`: what model and run the checkpoint is of; :func:`read_record` reads it from
a directory (without megatron-core), with ``mtp`` always known.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from typing import Any, Dict, Optional

from megatron_glm5.errors import UserError

#: version of the "glm5" record (raise it, and read the old one, when its meaning changes)
FORMAT_VERSION = 1
LATEST = "latest_checkpointed_iteration.txt"
PARTIAL_SUFFIX = ".partial"
ITER_DIR = re.compile(r"iter_(\d{7,})")
PARTIAL_DIR = re.compile(r"iter_\d{7,}\.partial")
DCP_METADATA = ".metadata"
MEGATRON_METADATA_FILE = "metadata.json"
MEGATRON_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
COMMON_KEY = "common_state/shard_0_1"  # megatron-core: ShardedObject("common_state", ..., (1,), (0,)).unique_key
LEGACY_COMMON_FILE = "common.pt"  # the common state of checkpoints written by older megatron-core
RECORD_KEY = "glm5"  # the ModelRecord's key in the common state
#: the parallel layout a checkpoint was written with (ModelRecord.layout), in megatron's flag names
LAYOUT_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
               "expert_tensor_parallel_size", "context_parallel_size", "data_parallel_size")


class CheckpointFormatError(UserError, ValueError):
    """A directory that is not a megatron-glm5 checkpoint as this module describes it (e.g. a bad pointer)."""


# ------------------------------------------------------------------------------------------------ directories


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def partial_dir(root: str, iteration: int) -> str:
    return iteration_dir(root, iteration) + PARTIAL_SUFFIX


def iteration_of(path: str) -> Optional[int]:
    """The iteration of an ``iter_XXXXXXX`` directory (None for any other name)."""
    m = ITER_DIR.fullmatch(os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else None


def complete_dirs(root: str) -> list[tuple[int, str]]:
    """(iteration, path) of every ``iter_XXXXXXX`` directory under root (not ``.partial``), newest first."""
    found = []
    if os.path.isdir(root):
        for name in os.listdir(root):
            m = ITER_DIR.fullmatch(name)
            if m and os.path.isdir(os.path.join(root, name)):
                found.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(found, reverse=True)


def partial_dirs(root: str) -> list[str]:
    """The ``iter_XXXXXXX.partial`` directories under root (saves that have not finished), sorted."""
    if not os.path.isdir(root):
        return []
    return sorted(os.path.join(root, n) for n in os.listdir(root) if PARTIAL_DIR.fullmatch(n))


# ------------------------------------------------------------------------------------------------ latest pointer


def read_latest(root: str) -> Optional[int]:
    """The iteration the ``latest`` pointer of a --save root names (None when there is no pointer)."""
    path = os.path.join(root, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        raw = f.read(64)
    text = raw.decode("ascii", errors="replace").strip()
    if not text.isdigit():
        raise CheckpointFormatError(f"{path}: expected an iteration number, found {text!r}")
    return int(text)


def pointed_dir(root: str, iteration: int) -> str:
    """The directory of the iteration the pointer names; an error when it is missing."""
    path = iteration_dir(root, iteration)
    if not os.path.isdir(path):
        raise CheckpointFormatError(f"{os.path.join(root, LATEST)} points to iteration {iteration}, but {path} "
                                    "is missing")
    return path


def write_latest(root: str, iteration: int) -> None:
    """Replace the pointer atomically (write aside, fsync, rename)."""
    tmp = os.path.join(root, LATEST + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, LATEST))


# --------------------------------------------------------------------------------------------- the model's identity

#: GLM5Config fields that do not change the function the model computes (generation ids, the init scale, the source)
NON_FUNCTIONAL_FIELDS = ("raw", "initializer_range", "bos_token_id", "eos_token_id")


def model_description(cfg) -> Dict[str, Any]:
    """Every field of a GLM5Config that changes what the model computes, JSON-ready and in a fixed order."""
    d = dataclasses.asdict(cfg)
    return {k: d[k] for k in sorted(d) if k not in NON_FUNCTIONAL_FIELDS}


def model_fingerprint(cfg) -> str:
    """A short stable hash of :func:`model_description` (a run's and a checkpoint's model identity)."""
    return description_fingerprint(model_description(cfg))


def description_fingerprint(description: Dict[str, Any]) -> str:
    text = json.dumps(description, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def differing_fields(saved: Dict[str, Any], current: Dict[str, Any]) -> list:
    """The keys whose values differ between two descriptions (sorted)."""
    return [k for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)]


def describe_difference(saved: Dict[str, Any], current: Dict[str, Any], limit: int = 6) -> str:
    """'field: saved -> current' for the fields that differ (at most ``limit`` named)."""
    keys = differing_fields(saved, current)
    shown = [f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in keys[:limit]]
    more = f" (and {len(keys) - limit} more)" if len(keys) > limit else ""
    return "; ".join(shown) + more


# ------------------------------------------------------------------------------------------------ the "glm5" record


def layout_record(tp: int, pp: int, ep: int, etp: int, cp: int, dp: Optional[int]) -> dict:
    """ModelRecord.layout: the parallel sizes by LAYOUT_KEYS (dp None: not fixed, as for a converted checkpoint)."""
    return dict(zip(LAYOUT_KEYS, (tp, pp, ep, etp, cp, dp)))


@dataclasses.dataclass(frozen=True)
class ModelRecord:
    """The ``"glm5"`` entry of a checkpoint's common state: what model and run it is of.

    Written by the trainer (``mode`` "pretrain"/"finetune", with ``trainable``) and by the HF converter (``mode``
    "converted", with ``mtp`` and ``source``); a field that does not apply is None and is not stored, so each
    writer stores the keys it always has. Reading takes either set (and a checkpoint missing any field but
    ``model_config``): absent fields read as None (``read_record`` fills in ``mtp`` from the stored tensors).
    """

    model_config: dict  # the HF config.json of the model
    layout: Optional[dict] = None  # layout_record() of the writer
    mode: Optional[str] = None  # "pretrain", "finetune" or "converted" (weights only: loaded as with --finetune)
    trainable: Optional[str] = None  # training: which parameters the optimizer state covers ("all", ...)
    mtp: Optional[bool] = None  # whether the checkpoint holds the MTP layer's weights (read_record fills it in)
    source: Optional[dict] = None  # converted: {"hf_dir", "dtype", "fp8_dequantized", "mtp": the HF dir had it}
    model_fingerprint: Optional[str] = None  # training: model_fingerprint() of the model (absent: older writers)
    model_description: Optional[dict] = None  # training: model_description() of the model (the fingerprint's text)
    global_batch_size: Optional[int] = None  # training: samples per iteration (a resume keeps it: --global-batch-size)
    format_version: int = FORMAT_VERSION

    def to_common(self) -> dict:
        """The value stored under RECORD_KEY (the fields that apply)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_common(cls, common) -> Optional["ModelRecord"]:
        """The record in a checkpoint's common state; None when there is none (not a megatron-glm5 checkpoint)."""
        entry = common.get(RECORD_KEY) if isinstance(common, dict) else None
        if not isinstance(entry, dict) or "model_config" not in entry:
            return None
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in entry.items() if k in names})


# ------------------------------------------------------------------------------------------------ reading a directory


def load_dcp_metadata(directory: str):
    """The ``.metadata`` index of a torch_dist directory (a torch ``Metadata``: chunks, shapes, where each item is)."""
    import pickle

    path = os.path.join(directory, DCP_METADATA)
    if not os.path.isfile(path):
        raise CheckpointFormatError(f"{directory}: no {DCP_METADATA} (not a torch_dist checkpoint, or its save did "
                                    "not finish)")
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a corrupt file
        raise CheckpointFormatError(f"{path}: cannot read the checkpoint metadata ({e})") from None


def read_dcp_object(directory: str, metadata, key: str, opened=None):
    """A ShardedObject (``torch.save``'d list of objects, e.g. the common state) stored under ``key``.

    ``opened(relative_path)``: an open binary file of the directory (the caller's cache), else the file is opened."""
    import io

    import torch

    info = next((i for idx, i in metadata.storage_data.items() if idx.fqn == key and idx.offset is None), None)
    if info is None:
        raise CheckpointFormatError(f"{directory}: the checkpoint has no object {key}")
    if getattr(info, "transform_descriptors", None):
        raise CheckpointFormatError(f"{directory}: {key} is stored with transforms {info.transform_descriptors} "
                                    "(compressed checkpoints are not supported)")
    path = os.path.join(directory, info.relative_path)
    if opened is None and not os.path.isfile(path):
        raise CheckpointFormatError(f"{directory}: data file {info.relative_path} named by {DCP_METADATA} is missing")
    f = opened(info.relative_path) if opened is not None else open(path, "rb")
    try:
        f.seek(info.offset)
        data = b""
        while len(data) < info.length:
            more = f.read(info.length - len(data))
            if not more:
                break
            data += more
    finally:
        if opened is None:
            f.close()
    if len(data) != info.length:
        raise CheckpointFormatError(f"{path}: {key} needs bytes {info.offset}..{info.offset + info.length}, the file "
                                    "ends before (truncated)")
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # noqa: BLE001 - a damaged record
        raise CheckpointFormatError(f"{path}: cannot read {key} ({type(e).__name__}: {e})") from None


def has_mtp_tensors(metadata) -> bool:
    """Whether a torch_dist index holds MTP weights (megatron-core's ``mtp.layers.*`` keys)."""
    return any(k.startswith("mtp.") and "optimizer" not in k for k in metadata.state_dict_metadata)


def read_record(directory: str, metadata=None, opened=None) -> ModelRecord:
    """The ModelRecord of a checkpoint directory (an ``iter_XXXXXXX`` or converted directory; a --save root is
    read at its latest pointer), with ``mtp`` filled in from the stored tensors when the writer did not record
    it. E.g. the trainer's ``--mtp`` default: ``read_record(path).mtp``. Not verified against the manifest."""
    pointer = read_latest(directory)
    if pointer is not None:
        directory = pointed_dir(directory, pointer)
    if metadata is None:
        metadata = load_dcp_metadata(directory)
    legacy = os.path.join(directory, LEGACY_COMMON_FILE)
    if os.path.isfile(legacy):
        import torch

        try:
            common = torch.load(legacy, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - a damaged file
            raise CheckpointFormatError(f"{legacy}: cannot read the common state ({type(e).__name__}: {e})") from None
    elif any(idx.fqn == COMMON_KEY for idx in metadata.storage_data):
        common = read_dcp_object(directory, metadata, COMMON_KEY, opened)
        common = common[0] if isinstance(common, list) and common else common
    else:
        raise CheckpointFormatError(f"{directory}: no common state in the checkpoint (not written by megatron-core?)")
    record = ModelRecord.from_common(common)
    if record is None:
        raise CheckpointFormatError(f"{directory}: not a megatron-glm5 checkpoint (no 'glm5' model description in "
                                    "its common state)")
    if record.mtp is None:
        record = dataclasses.replace(record, mtp=has_mtp_tensors(metadata))
    return record
