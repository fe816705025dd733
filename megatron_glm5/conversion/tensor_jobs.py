"""The tensor jobs of both conversions, and the file layouts that fix where each job writes before any runs.

Jobs are what parallel.py distributes (``nbytes`` + ``run(ctx)``); because every byte's place in the output is
decided here, up front and from the plan alone, the output is the same whichever worker writes a job.

torch_dist (HF -> megatron): ``ParallelDcpWriter`` is DCP's storage writer. In ``write_data`` it lays the plan's
items out exactly as one sequential writer does (``__0_<n>.distcp``, items in plan order, a new file once a file
has reached ``max_file_bytes``), using the length of each item's ``torch.save`` record — which depends only on the
tensor's shape and dtype (``record_length``: measured once per shape by saving an untouched tensor of that shape
into a byte counter) — then creates the files at their final sizes and hands one ``DcpItemJob`` per item to the
runner. Each job produces its chunk (reads the HF block, dequantises/casts) and ``torch.save``s it at its offset;
the written length is checked against the layout. DCP's own ``finish`` then writes ``.metadata`` from the layout
(on rank 0 only under torchrun). Its ``save_id`` is derived from the target path instead of being random, so two
conversions of the same input to the same place are byte-identical, ``.metadata`` included.

safetensors (megatron -> HF): the shard headers are computed from the plan (``shard_header``); each shard file is
created with its header and its final size; one ``ExportTensorJob`` per HF tensor reads its blocks from the
checkpoint (``TorchDistReader.read_region``) and writes them at the tensor's offset.
"""
from __future__ import annotations

import io
import math
import os
import uuid
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from megatron_glm5.conversion.safetensors_stream import OutTensor, shard_header
from megatron_glm5.conversion.torch_dist_stream import (
    LazyChunk,
    StreamingFileSystemWriter,
    TorchDistReader,
    produce_chunk,
)


class LayoutMismatch(RuntimeError):
    """A job wrote a different number of bytes than the layout planned (a torch.save format change?)."""


def _create_file(path: str, size: int, head: bytes = b"") -> None:
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)  # sparse until the jobs fill it


# ====================================================================== torch_dist
class _ByteCounter(io.RawIOBase):
    def __init__(self):
        self.n = 0

    def writable(self):
        return True

    def write(self, b):
        n = memoryview(b).nbytes
        self.n += n
        return n


_RECORD_LENGTHS: dict[tuple, int] = {}


def record_length(sizes, dtype: torch.dtype) -> int:
    """Bytes of ``torch.save`` of a contiguous tensor of ``sizes`` and ``dtype`` that owns its storage (the zip
    record depends on shape and dtype only, not on the values nor on where in a file it is written)."""
    key = (tuple(int(s) for s in sizes), dtype)
    if key not in _RECORD_LENGTHS:
        counter = _ByteCounter()
        torch.save(torch.empty(key[0], dtype=dtype), counter)  # pages never touched: costs no memory
        _RECORD_LENGTHS[key] = counter.n
    return _RECORD_LENGTHS[key]


@dataclass
class DcpItemJob:
    """One DCP item: a chunk (produced from the HF shards, ``torch.save``d) or an object's bytes, at ``offset``
    of ``path``."""
    path: str
    offset: int
    length: int
    nbytes: int  # tensor bytes (0 for an object): balance and progress
    chunk: Optional[LazyChunk] = None
    data: Optional[bytes] = None

    def run(self, ctx) -> None:
        f = ctx.file(self.path)
        f.seek(self.offset)
        if self.chunk is None:
            f.write(self.data)
        else:
            tensor = produce_chunk(self.chunk)
            torch.save(tensor, f)
            del tensor
        if f.tell() - self.offset != self.length:
            where = self.chunk.key if self.chunk is not None else "an object"
            raise LayoutMismatch(f"{self.path}: {where} took {f.tell() - self.offset} bytes at offset {self.offset}, "
                                 f"the layout planned {self.length}")
        ctx.progress(self.nbytes)


class ParallelDcpWriter(StreamingFileSystemWriter):
    """DCP storage writer whose items are written by ``runner`` (parallel.Runner) at precomputed offsets."""

    def __init__(self, path: str, runner, final_path: Optional[str] = None, on_item=None,
                 max_file_bytes: int = 10 * 2 ** 30, sync_files: bool = True):
        super().__init__(path, final_path=final_path, max_file_bytes=max_file_bytes, on_item=on_item,
                         sync_files=sync_files)
        self.runner = runner

    @property
    def is_coordinator(self) -> bool:
        return self.runner.is_coordinator

    def storage_meta(self):
        save_id = str(uuid.uuid5(uuid.NAMESPACE_URL, "megatron-glm5-conversion:" + self.final_path))
        return StorageMeta(checkpoint_id=self.final_path, save_id=save_id)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        prefix = plan.storage_data.prefix
        jobs, results, sizes, pos, name = [], [], {}, None, None
        for item in plan.items:
            entry = planner.take(item)
            if item.type == WriteItemType.BYTE_IO:
                data, chunk = bytes(entry.getbuffer()), None
                length, nbytes = len(data), 0
            else:
                data, chunk = None, entry
                length, nbytes = record_length(chunk.sizes, chunk.dtype), chunk.nbytes
            if pos is None or pos >= self.max_file_bytes:  # the sequential writer's rule
                name, pos = f"{prefix}{len(sizes)}.distcp", 0
            jobs.append(DcpItemJob(os.path.join(self.path, name), pos, length, nbytes, chunk, data))
            results.append(WriteResult(index=item.index, size_in_bytes=length,
                                       storage_data=_StorageInfo(name, pos, length)))
            pos += length
            sizes[name] = pos

        def create():
            for n, size in sizes.items():
                _create_file(os.path.join(self.path, n), size)

        self.runner.prepare(create)
        self.runner.run(jobs, on_bytes=self.on_item, marker_dir=self.path)
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata, results) -> None:
        if self.is_coordinator:
            super().finish(metadata, results)


# ====================================================================== safetensors
@dataclass
class ExportTensorJob:
    """One HF tensor: its blocks read from the torch_dist checkpoint ``checkpoint`` (global tensor ``key``, rows
    ``[r0, r1)`` at ``block(r0, r1)`` -> (offsets, sizes)), cast to the output dtype, written at ``offset``."""
    path: str
    offset: int
    out: OutTensor
    checkpoint: str
    key: str
    block: Callable
    max_block_bytes: int

    @property
    def nbytes(self) -> int:
        return self.out.nbytes

    def run(self, ctx) -> None:
        reader = ctx.resource(("torch_dist", self.checkpoint), lambda: TorchDistReader(self.checkpoint))
        t = self.out
        f = ctx.file(self.path)
        f.seek(self.offset)
        rows = t.shape[0] if t.shape else 1
        row_bytes = max(1, math.prod(t.shape[1:])) * max(t.dtype.itemsize, reader.dtype(self.key).itemsize)
        step = max(1, self.max_block_bytes // row_bytes)
        for r0 in range(0, rows, step):
            ctx.check_stop()
            r1 = min(rows, r0 + step)
            offsets, sizes = self.block(r0, r1)
            block = reader.read_region(self.key, offsets, sizes)
            shape = ((r1 - r0),) + tuple(t.shape[1:]) if t.shape else ()
            data = block.view(shape).to(t.dtype).contiguous()
            f.write(memoryview(data.view(-1).view(torch.uint8).numpy()))
            ctx.progress(data.nbytes)
            del block, data
        if f.tell() != self.offset + t.nbytes:
            raise LayoutMismatch(f"{self.path}: {t.name} took {f.tell() - self.offset} bytes, planned {t.nbytes}")


@dataclass
class ShardFile:
    path: str
    head: bytes
    size: int


def export_layout(directory: str, shards: list[list[OutTensor]], source_of: Callable[[str], tuple],
                  checkpoint: str, max_block_bytes: int) -> tuple[list[ShardFile], list[ExportTensorJob], dict]:
    """Shard files (``model-0000i-of-0000N.safetensors``: header, size), one job per tensor in file order, and the
    index's weight map. ``source_of(name)`` -> (checkpoint key, block function) of an HF tensor."""
    files, jobs, weight_map, n = [], [], {}, len(shards)
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        path = os.path.join(directory, name)
        head, offsets = shard_header(shard)
        files.append(ShardFile(path, head, len(head) + sum(t.nbytes for t in shard)))
        for t, off in zip(shard, offsets):
            key, block = source_of(t.name)
            jobs.append(ExportTensorJob(path, off, t, checkpoint, key, block, max_block_bytes))
            weight_map[t.name] = name
    return files, jobs, weight_map


def create_shard_files(files: list[ShardFile]) -> None:
    for sf in files:
        _create_file(sf.path, sf.size, sf.head)
