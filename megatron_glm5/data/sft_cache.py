"""The SFT token cache: a chat jsonl file is tokenized once per (file content, tokenizer, tokenization code) and
reused by later runs -- a restart, another layout, the evaluation -- instead of rendering every conversation's
chat template again (O(turns^2) renders each; ~1 s for the shipped 2,200 conversations on one core, hours for a
large SFT set).

What is cached: every record's ``(line number, ids, mask)`` as :func:`data.sft.tokenize_chat` returns it, before the
``seq_length`` truncation / drop decisions (those are cheap and depend on the run), and the file's line count. Only a
complete pass over a file with no bad line is written (a file with bad lines is tokenized each time, so its
warnings and skipped-sample counts come exactly as before; ``max_samples`` runs neither read nor write it).

Key: a BLAKE2 hash of the file's bytes, of the tokenizer (backend, vocabulary size, eod, special tokens, the chat
template, and the bytes of the files it was read from), of the source of the modules that decide the tokens (sft.py, tokenizer.py,
jsonl.py), and ``skip_bad`` / ``max_sample_bytes``. A changed file, template or code is a new key: nothing stale is
read. Files: ``<cache root>/sft/<stem>-<key>.npz``, written to a temporary name and renamed (a crash leaves no
partial entry; concurrent ranks write the same bytes). A file that cannot be read back is ignored (with one
warning) and rewritten. ``MEGATRON_GLM5_SFT_CACHE=0`` turns the cache off; ``MEGATRON_GLM5_SFT_CACHE=DIR`` moves it.
Entries are never deleted by the code (about 5 bytes per token): remove the directory to reclaim the space.
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from typing import Iterable, List, Optional, Sequence, Tuple

import numpy as np

from megatron_glm5.data.cache_root import cache_root

__all__ = ["ENV", "Tokenized", "cache_path", "load", "save"]

logger = logging.getLogger(__name__)

ENV = "MEGATRON_GLM5_SFT_CACHE"
Tokenized = List[Tuple[int, Sequence[int], Sequence[int]]]  # (line number, ids, mask) per record (lists or arrays)
_CODE = ("sft.py", "tokenizer.py", "jsonl.py")  # the modules whose code decides the tokens and masks


def _hash_file(h, path: str) -> None:
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)


def _tokenizer_files(name_or_path: str) -> Iterable[str]:
    if os.path.isfile(name_or_path):
        yield name_or_path
    elif os.path.isdir(name_or_path):
        for name in sorted(os.listdir(name_or_path)):
            full = os.path.join(name_or_path, name)
            if os.path.isfile(full):
                yield full


def cache_path(path: str, tokenizer, skip_bad: bool, max_sample_bytes: int) -> Optional[str]:
    """Where the tokens of ``path`` with ``tokenizer`` are cached; None when the cache is off."""
    setting = os.environ.get(ENV, "")
    source = getattr(tokenizer, "source", None)
    if setting == "0" or not os.path.isfile(path) or not source or not os.path.exists(source):
        return None  # off; a path the reader will refuse with its own message; a tokenizer not read from files
    root = setting or os.path.join(cache_root(), "sft")
    h = hashlib.blake2b(digest_size=16)
    try:
        _hash_file(h, path)
    except OSError:
        return None
    h.update(repr((tokenizer.backend, tokenizer.vocab_size, tokenizer.eod_id, sorted(tokenizer.special_ids.items()),
                   tokenizer.chat_template, bool(skip_bad), int(max_sample_bytes))).encode())
    for f in _tokenizer_files(source):
        h.update(os.path.basename(f).encode())
        _hash_file(h, f)
    here = os.path.dirname(os.path.abspath(__file__))
    for name in _CODE:
        _hash_file(h, os.path.join(here, name))
    stem = os.path.splitext(os.path.basename(path))[0]
    return os.path.join(root, f"{stem}-{h.hexdigest()}.npz")


def load(cache_file: Optional[str]) -> Optional[Tuple[Tokenized, int]]:
    """(records, lines of the file) from ``cache_file``, or None (off, absent, or unreadable: then rewritten)."""
    if cache_file is None or not os.path.isfile(cache_file):
        return None
    try:
        with np.load(cache_file) as z:
            ids, mask, ends, line_nos, lines = z["ids"], z["mask"], z["ends"], z["line_nos"], int(z["lines"])
        starts = np.concatenate([[0], ends[:-1]]) if len(ends) else ends
        records = [(int(n), ids[a:b], mask[a:b]) for n, a, b in zip(line_nos, starts, ends)]
        return records, lines
    except Exception as e:  # noqa: BLE001 - a damaged cache entry is recomputed, never trusted
        logger.warning("SFT token cache %s could not be read (%s: %s); tokenizing again", cache_file,
                       type(e).__name__, e)
        return None


def save(cache_file: Optional[str], records: Tokenized, lines: int) -> None:
    """Write ``records`` atomically to ``cache_file`` (a failure to write is logged, not raised)."""
    if cache_file is None:
        return
    try:
        os.makedirs(os.path.dirname(cache_file), exist_ok=True)
        lengths = np.array([len(ids) for _, ids, _ in records], dtype=np.int64)
        ids = np.fromiter((t for _, r, _ in records for t in r), dtype=np.int32, count=int(lengths.sum()))
        mask = np.fromiter((m for _, _, r in records for m in r), dtype=np.uint8, count=int(lengths.sum()))
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(cache_file), suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, ids=ids, mask=mask, ends=np.cumsum(lengths), lines=np.int64(lines),
                         line_nos=np.array([n for n, _, _ in records], dtype=np.int64))
            os.chmod(tmp, 0o644)
            os.replace(tmp, cache_file)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        logger.warning("SFT token cache %s could not be written (%s); the next run tokenizes again", cache_file, e)
