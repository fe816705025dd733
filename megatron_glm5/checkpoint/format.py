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
``"glm5"``, the :class:`ModelRecord`: what model and run the checkpoint is of.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Optional

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
    text = open(path).read().strip()
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
    ``model_config``): absent fields read as None.
    """

    model_config: dict  # the HF config.json of the model
    layout: Optional[dict] = None  # layout_record() of the writer
    mode: Optional[str] = None  # "pretrain", "finetune" or "converted" (weights only: loaded as with --finetune)
    trainable: Optional[str] = None  # training: which parameters the optimizer state covers ("all", ...)
    mtp: Optional[bool] = None  # converted: whether the MTP layer was converted
    source: Optional[dict] = None  # converted: {"hf_dir", "dtype", "fp8_dequantized"}
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
