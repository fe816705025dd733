"""Streaming safetensors I/O: read row blocks of one tensor, write shards tensor by tensor.

Both sides use plain file reads and writes (no memory map), so what a converter holds in memory is exactly the
block it is working on: the process's resident set does not grow with the checkpoint (an mmap'd shard would count
every page touched as resident).

``SafetensorsSource(dir)`` parses the headers of every shard up front (one small read per file) and checks them:
an index naming a missing file, a header that is not JSON, a file shorter than its header declares (truncated
download), a tensor whose byte range disagrees with its dtype and shape. Errors name the file.

``SafetensorsShardWriter`` writes a shard whose header is known before any data (names, dtypes, shapes), then the
tensors' bytes in header order, block by block.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Iterable

import torch

from megatron_glm5.conversion.safetensors_io import INDEX_NAME, SINGLE_NAME, CheckpointError

DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "BOOL": torch.bool,
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("F8_E8M0", "float8_e8m0fnu")):
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 512 * 2 ** 20


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str  # shard file name (relative to the directory)
    dtype_name: str  # safetensors spelling: BF16, F32, F8_E4M3, ...
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the data in the file
    nbytes: int

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.dtype_name]

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else self.nbytes


def read_exact(f, offset: int, out: torch.Tensor, path: str) -> None:
    """Fill the uint8 tensor ``out`` from ``f`` at ``offset`` (plain reads, no mmap)."""
    view = memoryview(out.numpy()).cast("B")
    f.seek(offset)
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise CheckpointError(f"{path}: file ends at byte {offset + got}, {len(view) - got} bytes short "
                                  "(truncated or still being written?)")
        got += n


class SafetensorsSource:
    """All tensors of an HF checkpoint directory (single file or sharded), by name; reads on demand."""

    def __init__(self, directory: str):
        self.directory = os.fspath(directory)
        index_path = os.path.join(self.directory, INDEX_NAME)
        if os.path.isfile(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError("weight_map is not an object")
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index_path}: not a valid safetensors index ({e})") from None
            files = sorted(set(weight_map.values()))
            for shard in files:
                if not os.path.isfile(os.path.join(self.directory, shard)):
                    raise CheckpointError(f"{index_path} names shard {shard}, which is missing from "
                                          f"{self.directory}")
        elif os.path.isfile(os.path.join(self.directory, SINGLE_NAME)):
            weight_map, files = None, [SINGLE_NAME]
        else:
            raise CheckpointError(f"{self.directory}: no {SINGLE_NAME} or {INDEX_NAME} (is this an HF model "
                                  "directory?)")
        self.tensors: dict[str, TensorInfo] = {}
        for shard in files:
            for info in self._parse_header(shard):
                if weight_map is not None and weight_map.get(info.name) != shard:
                    continue  # not listed for this shard: transformers would not load it either
                self.tensors[info.name] = info
        if weight_map is not None:
            missing = sorted(k for k in weight_map if k not in self.tensors)
            if missing:
                raise CheckpointError(f"{os.path.join(self.directory, weight_map[missing[0]])}: does not contain "
                                      f"{missing[0]}, which {INDEX_NAME} places there")
        self._files = {}

    def _parse_header(self, shard: str) -> list[TensorInfo]:
        path = os.path.join(self.directory, shard)
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: not a safetensors file (only {size} bytes; truncated?)")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, _MAX_HEADER):
                raise CheckpointError(f"{path}: not a safetensors file, or truncated (header of {n} bytes in a "
                                      f"{size}-byte file)")
            raw = f.read(n)
        try:
            header = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
        base = 8 + n
        out = []
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype_name, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{path}: corrupt safetensors header entry for {name}") from None
            if dtype_name not in DTYPES:
                raise CheckpointError(f"{path}: {name} has dtype {dtype_name}, which this converter cannot read")
            nbytes = math.prod(shape) * element_size(DTYPES[dtype_name])
            if end - begin != nbytes:
                raise CheckpointError(f"{path}: {name} declares {end - begin} bytes for {dtype_name} {list(shape)} "
                                      f"({nbytes} expected): corrupt header")
            if base + end > size:
                raise CheckpointError(f"{path}: truncated: {name} ends at byte {base + end} but the file has "
                                      f"{size} bytes (re-download this shard)")
            out.append(TensorInfo(name, shard, dtype_name, shape, base + begin, nbytes))
        return out

    # -------------------------------------------------------------- access
    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def keys(self) -> Iterable[str]:
        return self.tensors.keys()

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.directory}: tensor {name} is not in the checkpoint") from None

    def path_of(self, name: str) -> str:
        return os.path.join(self.directory, self.info(name).file)

    def read_rows(self, name: str, r0: int = 0, r1: int | None = None) -> torch.Tensor:
        """Rows [r0, r1) of a tensor (the whole tensor by default), in its stored dtype, in fresh memory."""
        info = self.info(name)
        if not info.shape:
            r0, r1, shape = 0, 1, ()
        else:
            r1 = info.shape[0] if r1 is None else r1
            shape = (r1 - r0,) + info.shape[1:]
        buf = torch.empty((r1 - r0) * info.row_bytes, dtype=torch.uint8)
        f = self._files.get(info.file)
        if f is None:
            f = self._files[info.file] = open(os.path.join(self.directory, info.file), "rb", buffering=0)
        read_exact(f, info.start + r0 * info.row_bytes, buf, os.path.join(self.directory, info.file))
        return buf.view(info.dtype).view(shape)

    def close(self):
        for f in self._files.values():
            f.close()
        self._files = {}

    def __getstate__(self):  # sent to conversion workers (parallel.py): each opens its own files
        state = dict(self.__dict__)
        state["_files"] = {}
        return state


# ------------------------------------------------------------------ writing
def parse_size(text) -> int:
    """'5GB' (10^9), '500MB', '2GiB' (2^30), or a number of bytes -> bytes (transformers' convention)."""
    if isinstance(text, int):
        return text
    s = str(text).strip().upper()
    units = [("GIB", 2 ** 30), ("MIB", 2 ** 20), ("KIB", 2 ** 10), ("GB", 10 ** 9), ("MB", 10 ** 6), ("KB", 10 ** 3),
             ("B", 1)]
    for suffix, mult in units:
        if s.endswith(suffix):
            return int(float(s[: -len(suffix)]) * mult)
    return int(s)


@dataclass(frozen=True)
class OutTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * element_size(self.dtype)


def plan_shards(tensors: list[OutTensor], max_shard_bytes: int) -> list[list[OutTensor]]:
    """Greedy in order: a shard is closed when the next tensor would take it past max_shard_bytes."""
    shards, current, size = [], [], 0
    for t in tensors:
        if current and size + t.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(t)
        size += t.nbytes
    if current:
        shards.append(current)
    return shards


def shard_header(tensors: list[OutTensor], metadata: dict | None = None) -> tuple[bytes, list[int]]:
    """The bytes a shard starts with (8-byte length + JSON header, padded to 8) and each tensor's absolute byte
    offset in the file: the whole layout of a shard, known before any data."""
    header, offset = {"__metadata__": dict(metadata or {"format": "pt"})}, 0
    relative = []
    for t in tensors:
        header[t.name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        relative.append(offset)
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    head = struct.pack("<Q", len(raw)) + raw
    return head, [len(head) + r for r in relative]


class SafetensorsShardWriter:
    """Write one safetensors file: the header first (all names/dtypes/shapes known), then each tensor's bytes in
    header order, in as many blocks as the caller likes (``write(block)``)."""

    def __init__(self, path: str, tensors: list[OutTensor], metadata: dict | None = None):
        self.path, self.tensors = path, tensors
        head, _ = shard_header(tensors, metadata)
        self.total = sum(t.nbytes for t in tensors)
        self.f = open(path, "wb")
        self.f.write(head)
        self._index, self._written = 0, 0  # tensor being written, its bytes written so far

    def write(self, block: torch.Tensor) -> None:
        """Append the next bytes of the current tensor (a block of whole rows, in the tensor's dtype)."""
        t = self.tensors[self._index]
        if block.dtype != t.dtype:
            raise ValueError(f"{t.name}: block dtype {block.dtype} != {t.dtype}")
        data = block.contiguous().view(-1).view(torch.uint8)
        self.f.write(memoryview(data.numpy()))
        self._written += data.numel()
        if self._written > t.nbytes:
            raise ValueError(f"{t.name}: more bytes written than its shape holds")
        if self._written == t.nbytes:
            self._index, self._written = self._index + 1, 0

    def close(self, fsync: bool = True) -> None:
        if self._index != len(self.tensors):
            self.f.close()
            raise ValueError(f"{self.path}: closed after {self._index} of {len(self.tensors)} tensors")
        self.f.flush()
        if fsync:
            os.fsync(self.f.fileno())
        self.f.close()
