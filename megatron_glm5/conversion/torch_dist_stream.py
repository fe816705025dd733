"""Streaming access to megatron-core's torch_dist checkpoints (PyTorch Distributed Checkpoint, DCP), one block at
a time in both directions.

What megatron-core writes (``dist_checkpointing.save`` -> ``strategies/torch.py``): a DCP directory whose
``.metadata`` (a pickled ``torch.distributed.checkpoint.Metadata``) lists, per ShardedTensor key, the global
shape, the dtype and the stored chunks (offsets + sizes), and where each chunk's bytes are (file, offset,
length; each chunk is one ``torch.save`` record); ShardedObjects (``_extra_state``, and the common state dict
under ``common_state/shard_0_1``) are ``torch.save``'d lists stored as byte items; megatron adds
``metadata.json`` (``{"sharded_backend": "torch_dist", ...}``). Loading (``dist_checkpointing.load`` -> DCP)
asks for the regions each rank holds and reads every stored chunk that overlaps them, so a checkpoint stored in
*any* chunking loads into *any* parallel layout.

Writing (HF -> torch_dist): ``save_lazy`` hands DCP a plan of chunks whose data does not exist yet. The
``LazySavePlanner`` produces each chunk on demand in ``resolve_data`` (read HF bytes, combine, cast) and forgets it;
``StreamingFileSystemWriter`` replaces DCP's ``FileSystemWriter.write_data`` (which keeps a reference to every
tensor of a file until the file is complete) with a loop that writes each chunk as soon as it is produced and
drops it. Peak memory: one chunk (plus DCP's metadata).

Reading (torch_dist -> HF): ``TorchDistReader.read_region(key, offsets, sizes)`` reads exactly a block of a
global tensor: for each overlapping stored chunk it locates the raw tensor bytes inside the ``torch.save``
record (zip entry ``data/<n>``, uncompressed) and reads only the needed byte runs. A stored chunk larger than the
block (e.g. all 256 experts of a layer saved by an EP1 run) is never loaded whole.
"""
from __future__ import annotations

import dataclasses
import io
import itertools
import math
import os
import pickle
import struct
import warnings
import zipfile
from collections import OrderedDict
from torch.futures import Future
from typing import Callable, Iterable

import torch
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter, Metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from megatron_glm5.checkpoint.format import (
    MEGATRON_METADATA,
    MEGATRON_METADATA_FILE,
    load_dcp_metadata,
    read_dcp_object,
    read_record,
)
from megatron_glm5.conversion.safetensors_io import CheckpointError
from megatron_glm5.conversion.safetensors_stream import read_exact



# ================================================================== writing
@dataclasses.dataclass
class LazyChunk:
    """One stored chunk of a global tensor: ``produce()`` returns a contiguous tensor of ``sizes`` and ``dtype``."""
    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor]
    source: str = ""  # what it is made of (the HF tensor name), for messages and tests

    @property
    def nbytes(self) -> int:
        return math.prod(self.sizes) * torch.empty((), dtype=self.dtype).element_size()


def serialize_object(obj) -> io.BytesIO:
    """A ShardedObject's bytes as megatron-core stores them: ``torch.save`` of the list of this rank's objects."""
    buf = io.BytesIO()
    torch.save([obj], buf)
    buf.seek(0)
    return buf


class LazySavePlanner(SavePlanner):
    """A DCP SavePlanner over chunks that are produced on demand (``resolve_data``) and released after writing."""

    def __init__(self, chunks: Iterable[LazyChunk], objects: dict[str, io.BytesIO]):
        self._items, self._producers = [], {}
        for key, data in objects.items():
            self._items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
            self._producers[(key, None)] = data
        for c in chunks:
            index = MetadataIndex(c.key, c.offsets)
            if (c.key, tuple(c.offsets)) in self._producers:
                raise ValueError(f"chunk {c.key} at {c.offsets} planned twice")
            self._items.append(WriteItem(
                index=index, type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)),
                    properties=TensorProperties(dtype=c.dtype), size=torch.Size(c.global_shape))))
            self._producers[(c.key, tuple(c.offsets))] = c
        self.metadata = None

    def set_up_planner(self, state_dict=None, storage_meta=None, is_coordinator: bool = True) -> None:
        pass

    def create_local_plan(self) -> SavePlan:
        return SavePlan(self._items)

    def create_global_plan(self, all_plans):
        plans, self.metadata = create_default_global_save_plan(all_plans)
        return plans, self.metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def take(self, write_item: WriteItem):
        """The item's LazyChunk (or BytesIO), forgotten by the planner (released once written)."""
        offsets = None if write_item.index.offset is None else tuple(write_item.index.offset)
        return self._producers.pop((write_item.index.fqn, offsets))

    def resolve_data(self, write_item: WriteItem):
        entry = self.take(write_item)
        return entry if isinstance(entry, io.BytesIO) else produce_chunk(entry)


def produce_chunk(entry: LazyChunk) -> torch.Tensor:
    """Run a chunk's producer, check it against the plan, and make it a tensor that owns exactly its bytes."""
    tensor = entry.produce()
    if tuple(tensor.shape) != tuple(entry.sizes) or tensor.dtype != entry.dtype:
        raise AssertionError(f"{entry.key} at {entry.offsets}: produced {tuple(tensor.shape)} {tensor.dtype}, "
                             f"planned {entry.sizes} {entry.dtype}")
    if not tensor.is_contiguous() or tensor.untyped_storage().nbytes() != tensor.nbytes:
        tensor = tensor.contiguous().clone()  # torch.save writes the whole storage
    return tensor


class StreamingFileSystemWriter(FileSystemWriter):
    """DCP FileSystemWriter whose ``write_data`` writes each item as soon as it is resolved and keeps nothing.

    Items go to ``__0_<n>.distcp`` files of about ``max_file_bytes`` each, in plan order. ``on_item(nbytes)`` is
    called after every item (progress bars). ``checkpoint_id`` is the final directory name recorded in the
    metadata (the files are written to a temporary directory that is renamed afterwards).
    """

    def __init__(self, path: str, final_path: str | None = None, max_file_bytes: int = 10 * 2 ** 30,
                 on_item: Callable[[int], None] | None = None, sync_files: bool = True):
        super().__init__(path, single_file_per_rank=True, sync_files=sync_files, thread_count=1, overwrite=False)
        self.final_path = final_path or os.fspath(path)
        self.max_file_bytes = max_file_bytes
        self.on_item = on_item

    def storage_meta(self):
        return StorageMeta(checkpoint_id=self.final_path, save_id=self.save_id)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        prefix = plan.storage_data.prefix
        results, stream, file_name, n_files = [], None, None, 0

        def close(s):
            s.flush()
            if self.sync_files:
                os.fsync(s.fileno())
            s.close()

        try:
            for item in plan.items:
                if stream is None or stream.tell() >= self.max_file_bytes:
                    if stream is not None:
                        close(stream)
                    file_name = f"{prefix}{n_files}.distcp"
                    n_files += 1
                    stream = open(os.path.join(self.path, file_name), "wb")
                data = planner.resolve_data(item)
                offset = stream.tell()
                if item.type == WriteItemType.BYTE_IO:
                    stream.write(data.getbuffer())
                else:
                    torch.save(data, stream)
                length = stream.tell() - offset
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=_StorageInfo(file_name, offset, length)))
                if self.on_item is not None:  # progress in the unit of the plan's total: tensor bytes
                    self.on_item(data.nbytes if item.type != WriteItemType.BYTE_IO else 0)
                del data
        finally:
            if stream is not None:
                close(stream)
        fut: Future = Future()
        fut.set_result(results)
        return fut


def save_lazy(path: str, chunks: Iterable[LazyChunk], objects: dict[str, io.BytesIO], final_path: str | None = None,
              on_item=None, max_file_bytes: int = 10 * 2 ** 30, sync_files: bool = True,
              storage_writer=None) -> Metadata:
    """Write a torch_dist checkpoint (DCP files + megatron's metadata.json) from lazily produced chunks.

    Needs no process group: one process writes the global tensors (each chunk carries its global offset).
    ``storage_writer``: another writer (tensor_jobs.ParallelDcpWriter: the items written by worker processes);
    one whose ``is_coordinator`` is False writes its share only, no metadata."""
    import json

    os.makedirs(path, exist_ok=True)
    planner = LazySavePlanner(chunks, objects)
    writer = storage_writer or StreamingFileSystemWriter(path, final_path=final_path, on_item=on_item,
                                                         max_file_bytes=max_file_bytes, sync_files=sync_files)
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process": yes
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
        try:
            dcp.save({}, storage_writer=writer, planner=planner, no_dist=True)
        except CheckpointException as e:  # DCP wraps what went wrong (a bad shard, Ctrl-C): re-raise that
            failures = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]  # (exc, traceback)
            failures = [f for f in failures if isinstance(f, BaseException)]
            if len(failures) == 1:
                raise failures[0] from None
            raise
    if getattr(writer, "is_coordinator", True):
        with open(os.path.join(path, MEGATRON_METADATA_FILE), "w") as f:
            json.dump(MEGATRON_METADATA, f)
    return planner.metadata


# ================================================================== reading
class _Window(io.RawIOBase):
    """Read-only, seekable view of bytes [start, start + length) of an open file."""

    def __init__(self, f, start: int, length: int):
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, offset, whence=io.SEEK_SET):
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, b):
        n = max(0, min(len(b), self.length - self.pos))
        if n == 0:
            return 0
        self.f.seek(self.start + self.pos)
        got = self.f.readinto(memoryview(b)[:n])
        self.pos += got
        return got


class _Unsupported(Exception):
    pass


@dataclasses.dataclass
class _StorageRef:
    key: str
    dtype: torch.dtype | None
    numel: int


@dataclasses.dataclass
class _TensorRecord:
    storage: _StorageRef
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def _rebuild_v2(storage, storage_offset, size, stride, requires_grad=False, hooks=None, metadata=None):
    return _TensorRecord(storage, storage_offset, tuple(size), tuple(stride), storage.dtype)


def _rebuild_v3(storage, storage_offset, size, stride, requires_grad, hooks, dtype, metadata=None):
    return _TensorRecord(storage, storage_offset, tuple(size), tuple(stride), dtype)


class _DescribeUnpickler(pickle.Unpickler):
    """Reads a torch.save pickle of a single tensor without touching its storage bytes."""

    def find_class(self, module, name):
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_v2
        if module == "torch._utils" and name == "_rebuild_tensor_v3":
            return _rebuild_v3
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "torch" and name.endswith("Storage"):
            with warnings.catch_warnings():  # legacy typed-storage classes warn on use
                warnings.simplefilter("ignore")
                return ("typed", getattr(torch, name).dtype)
        if module == "torch.storage" and name == "UntypedStorage":
            return ("untyped", None)
        raise _Unsupported(f"{module}.{name}")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
            raise _Unsupported(str(pid))
        _, storage_type, key, _location, numel = pid
        return _StorageRef(str(key), storage_type[1], int(numel))


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))


class TorchDistReader:
    """Blocks of global tensors (and objects) of a torch_dist checkpoint, read on demand."""

    def __init__(self, path: str):
        self.path = os.fspath(path)
        self.metadata: Metadata = load_dcp_metadata(self.path)
        self._chunks: dict[str, list[tuple[tuple, tuple, _StorageInfo]]] = {}
        sizes_of = {}
        for fqn, md in self.metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                sizes_of[fqn] = {tuple(c.offsets): tuple(c.sizes) for c in md.chunks}
        for index, info in self.metadata.storage_data.items():
            if index.offset is None:
                continue
            off = tuple(index.offset)
            self._chunks.setdefault(index.fqn, []).append((off, sizes_of[index.fqn][off], info))
        self._objects = {index.fqn: info for index, info in self.metadata.storage_data.items() if index.offset is None}
        self._files: dict[str, object] = {}
        self._records: dict[tuple[str, int], _TensorRecord | None] = {}
        self.bytes_read = 0

    # -------------------------------------------------------------- description
    def tensor_keys(self) -> list[str]:
        return [k for k, v in self.metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)]

    def __contains__(self, key: str) -> bool:
        return isinstance(self.metadata.state_dict_metadata.get(key), TensorStorageMetadata)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._md(key).size)

    def dtype(self, key: str) -> torch.dtype:
        return self._md(key).properties.dtype

    def _md(self, key: str) -> TensorStorageMetadata:
        md = self.metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"{self.path}: the checkpoint has no tensor {key}")
        return md

    def _file(self, relative: str):
        f = self._files.get(relative)
        if f is None:
            path = os.path.join(self.path, relative)
            if not os.path.isfile(path):
                raise CheckpointError(f"{self.path}: data file {relative} named by .metadata is missing")
            f = self._files[relative] = open(path, "rb", buffering=0)
        return f

    def close(self):
        for f in self._files.values():
            f.close()
        self._files = {}

    # -------------------------------------------------------------- objects
    def read_object(self, key: str):
        return read_dcp_object(self.path, self.metadata, key, opened=self._file)

    def record(self):
        """The checkpoint's "glm5" ModelRecord (checkpoint/format.py ``read_record``), ``mtp`` filled in."""
        return read_record(self.path, self.metadata, opened=self._file)

    def has_object(self, key: str) -> bool:
        return key in self._objects

    # -------------------------------------------------------------- tensors
    def _check_plain(self, info: _StorageInfo, key: str):
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{self.path}: {key} is stored with transforms {info.transform_descriptors} "
                                  "(compressed checkpoints are not supported)")

    def _record(self, info: _StorageInfo) -> tuple[_TensorRecord, int] | None:
        """(tensor record, absolute byte offset of its storage data) of one torch.save'd chunk, or None when the
        record is not a plain tensor we can address (then it is read whole with torch.load)."""
        cache_key = (info.relative_path, info.offset)
        if cache_key in self._records:
            return self._records[cache_key]
        f = self._file(info.relative_path)
        result = None
        try:
            window = _Window(f, info.offset, info.length)
            zf = zipfile.ZipFile(window)
            pkl = next(n for n in zf.namelist() if n.endswith("data.pkl"))
            record = _DescribeUnpickler(io.BytesIO(zf.read(pkl))).load()
            if isinstance(record, _TensorRecord):
                zinfo = zf.getinfo(pkl[: -len("data.pkl")] + "data/" + record.storage.key)
                if zinfo.compress_type == zipfile.ZIP_STORED:
                    window.seek(zinfo.header_offset)
                    head = window.read(30)
                    if head[:4] == b"PK\x03\x04":
                        n, m = struct.unpack("<HH", head[26:30])
                        result = (record, info.offset + zinfo.header_offset + 30 + n + m)
        except (_Unsupported, zipfile.BadZipFile, StopIteration, KeyError, pickle.UnpicklingError):
            result = None
        self._records[cache_key] = result
        return result

    def read_region(self, key: str, offsets, sizes) -> torch.Tensor:
        """The block ``[offsets, offsets + sizes)`` of global tensor ``key``, in its stored dtype."""
        md = self._md(key)
        offsets, sizes = tuple(int(o) for o in offsets), tuple(int(s) for s in sizes)
        if len(offsets) != len(md.size) or any(o + s > g for o, s, g in zip(offsets, sizes, md.size)):
            raise CheckpointError(f"{self.path}: block {offsets}+{sizes} is outside {key} {tuple(md.size)}")
        out = torch.empty(sizes, dtype=md.properties.dtype)
        covered = 0
        for c_off, c_size, info in self._chunks.get(key, []):
            lo = tuple(max(a, b) for a, b in zip(offsets, c_off))
            hi = tuple(min(a + s, b + t) for a, s, b, t in zip(offsets, sizes, c_off, c_size))
            if any(h <= l for l, h in zip(lo, hi)):
                continue
            n = tuple(h - l for l, h in zip(lo, hi))
            src_lo = tuple(l - c for l, c in zip(lo, c_off))
            dst = out[tuple(slice(l - o, l - o + k) for l, o, k in zip(lo, offsets, n))]
            self._read_box(key, info, c_size, md.properties.dtype, src_lo, n, dst)
            covered += math.prod(n)
        if covered != math.prod(sizes):
            raise CheckpointError(f"{self.path}: the stored chunks of {key} cover {covered} of the "
                                  f"{math.prod(sizes)} elements of block {offsets}+{sizes} (incomplete checkpoint)")
        return out

    def _read_box(self, key, info: _StorageInfo, c_size, dtype, src_lo, n, dst: torch.Tensor):
        self._check_plain(info, key)
        rec = self._record(info)
        if rec is not None:
            record, data_start = rec
            ok = (record.size == tuple(c_size) and record.dtype == dtype
                  and record.stride == _contiguous_strides(c_size) and (record.storage.dtype in (None, dtype)))
            if not ok:
                rec = None
        if rec is None:  # unusual record: load the whole chunk (correct, not memory-lean)
            buf = torch.empty(info.length, dtype=torch.uint8)
            read_exact(self._file(info.relative_path), info.offset, buf, os.path.join(self.path, info.relative_path))
            whole = torch.load(io.BytesIO(buf.numpy().tobytes()), weights_only=True)
            del buf
            dst.copy_(whole[tuple(slice(l, l + k) for l, k in zip(src_lo, n))])
            self.bytes_read += info.length
            return
        record, data_start = rec
        esize = torch.empty((), dtype=dtype).element_size()
        strides = _contiguous_strides(c_size)
        base = data_start + record.storage_offset * esize
        path = os.path.join(self.path, info.relative_path)
        f = self._file(info.relative_path)
        nd = len(c_size)
        if nd == 0:
            buf = torch.empty(esize, dtype=torch.uint8)
            read_exact(f, base, buf, path)
            dst.copy_(buf.view(dtype).view(()))
            self.bytes_read += esize
            return
        # dims j.. form one contiguous run for each index of the leading dims < j
        j = nd - 1
        while j > 0 and src_lo[j] == 0 and n[j] == c_size[j]:
            j -= 1
        run = n[j] * math.prod(c_size[j + 1:])
        first = sum(l * s for l, s in zip(src_lo, strides))
        last_start = sum((l + k - 1) * s for l, k, s in zip(src_lo[:j], n[:j], strides[:j])) + src_lo[j] * strides[j]
        span = last_start + run - first
        needed = math.prod(n)
        if span == needed and dst.is_contiguous():  # one contiguous run: read straight into the destination
            read_exact(f, base + first * esize, dst.view(-1).view(torch.uint8), path)
            self.bytes_read += span * esize
            return
        if span <= max(2 * needed, (64 * 2 ** 20) // esize):  # read the covering span once, then view the box
            buf = torch.empty(span * esize, dtype=torch.uint8)
            read_exact(f, base + first * esize, buf, path)
            dst.copy_(buf.view(dtype).as_strided(n, strides))
            self.bytes_read += span * esize
            return
        inner_shape = n[j:]
        for lead in itertools.product(*[range(l, l + k) for l, k in zip(src_lo[:j], n[:j])]):
            start = sum(i * s for i, s in zip(lead, strides)) + src_lo[j] * strides[j]
            buf = torch.empty(run * esize, dtype=torch.uint8)
            read_exact(f, base + start * esize, buf, path)
            dst[tuple(i - l for i, l in zip(lead, src_lo))].copy_(buf.view(dtype).view(inner_shape))
            self.bytes_read += run * esize
