"""Checks of a Megatron indexed dataset (``PREFIX.idx`` + ``PREFIX.bin``) before megatron-core reads it: a garbage
or truncated file would otherwise end in an assertion, a numpy error or tokens read past the data.

The ``.idx`` layout (megatron-core's ``IndexedDatasetBuilder``): the 9-byte magic ``MMIDIDX\\0\\0``, version (u64,
1), dtype code (u8), sequence count S (u64), document count D (u64), then S int32 lengths, S int64 byte pointers
into ``.bin`` and D int64 document indices (0 first, S last).  Only the header and the last entries are read, so
the check costs the same for any corpus size.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from megatron_glm5.data.jsonl import DataError

__all__ = ["IndexSummary", "check_indexed_prefix"]

_MAGIC = b"MMIDIDX\x00\x00"
_HEADER = struct.Struct("<9sQBQQ")  # 34 bytes
_ITEM_SIZE = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}  # megatron-core's DType codes -> bytes per token
_REBUILD = "rebuild it with tools/preprocess_data.py"


@dataclass(frozen=True)
class IndexSummary:
    sequences: int  # what megatron-core's GPTDataset splits (one per document in preprocess_data.py's output)
    documents: int
    token_bytes: int


def check_indexed_prefix(prefix: str) -> IndexSummary:
    """The summary of ``prefix``'s index, or :class:`DataError` naming the file that is not a complete dataset."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    for path in (idx, bin_):
        if not os.path.isfile(path):
            raise DataError(f"{path}: no such file (a Megatron prefix needs {prefix}.bin and {prefix}.idx; build "
                            "them with tools/preprocess_data.py)", "missing_file")
    size = os.path.getsize(idx)
    with open(idx, "rb") as f:
        head = f.read(_HEADER.size)
        if len(head) < _HEADER.size:
            if not _MAGIC.startswith(head[:len(_MAGIC)]):
                raise DataError(f"{idx}: not a Megatron index (starts with {head[:9]!r}); {_REBUILD}", "bad_index")
            raise DataError(f"{idx}: truncated ({size} bytes, shorter than the {_HEADER.size}-byte header); "
                            f"{_REBUILD}", "bad_index")
        magic, version, code, seqs, docs = _HEADER.unpack(head)
        if magic != _MAGIC:
            raise DataError(f"{idx}: not a Megatron index (starts with {magic!r}, expected {_MAGIC!r}); {_REBUILD}",
                            "bad_index")
        if version != 1 or code not in _ITEM_SIZE:
            raise DataError(f"{idx}: unsupported index (version {version}, dtype code {code}); {_REBUILD}",
                            "bad_index")
        expected = _HEADER.size + 12 * seqs + 8 * docs
        if size not in (expected, expected + seqs):  # + one mode byte per sequence in a multimodal index
            what = "truncated" if size < expected else "corrupted (longer than its header says)"
            raise DataError(f"{idx}: {what}: {seqs} sequences and {docs} document entries need {expected} bytes, "
                            f"the file has {size}; {_REBUILD}", "bad_index")
        if seqs == 0 or docs < 2:
            raise DataError(f"{idx}: holds no documents; {_REBUILD} from a file with text", "bad_index")
        f.seek(_HEADER.size + 4 * (seqs - 1))
        (last_length,) = struct.unpack("<i", f.read(4))
        f.seek(_HEADER.size + 4 * seqs + 8 * (seqs - 1))
        (last_pointer,) = struct.unpack("<q", f.read(8))
        f.seek(_HEADER.size + 12 * seqs)
        (first_doc,) = struct.unpack("<q", f.read(8))
        f.seek(_HEADER.size + 12 * seqs + 8 * (docs - 1))
        (last_doc,) = struct.unpack("<q", f.read(8))
    if first_doc != 0 or last_doc != seqs or last_length < 0 or last_pointer < 0:
        raise DataError(f"{idx}: corrupted (its document entries run from {first_doc} to {last_doc}, not 0 to its "
                        f"{seqs} sequences); {_REBUILD}", "bad_index")
    token_bytes = last_pointer + last_length * _ITEM_SIZE[code]
    bin_size = os.path.getsize(bin_)
    if bin_size != token_bytes:
        what = "truncated" if bin_size < token_bytes else "not the data of this index (longer)"
        raise DataError(f"{bin_}: {what}: {idx} places {token_bytes} bytes of tokens in it, the file has {bin_size}; "
                        f"{_REBUILD}", "bad_index")
    return IndexSummary(sequences=seqs, documents=docs - 1, token_bytes=token_bytes)
