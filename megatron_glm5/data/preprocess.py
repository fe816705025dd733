"""Preprocessing: a jsonl file -> a Megatron indexed dataset (``PREFIX.bin``/``PREFIX.idx``).

Also ``tools/preprocess_data.py``::

    preprocess_jsonl("corpus.jsonl", "data/corpus", tokenizer="path/to/tokenizer", workers=8, append_eod=True)

writes ``data/corpus.bin`` and ``data/corpus.idx`` (one document per jsonl line, dtype uint16 when the vocabulary
fits, else int32) with ``megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder``.  The files are written
under temporary names and renamed when complete, so an interrupted run leaves no ``PREFIX.bin``/``PREFIX.idx``;
a prefix whose files exist is skipped unless ``overwrite=True`` (so a list of inputs can be re-run after a crash).
"""
from __future__ import annotations

import glob
import logging
import multiprocessing
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import numpy as np

from megatron_glm5.data.jsonl import (MAX_SAMPLE_BYTES, SKIPPED_SAMPLES, DataError, JsonlStats, check_jsonl_path,
                                      iter_raw_lines, parse_jsonl_line, too_long_error)
from megatron_glm5.data.tokenizer import TokenizerLike, load_tokenizer

__all__ = ["PreprocessResult", "preprocess_jsonl", "prefix_is_complete", "token_dtype_for_vocab"]

logger = logging.getLogger(__name__)

_BATCH_LINES = 256


@dataclass
class PreprocessResult:
    prefix: str
    documents: int = 0          # documents written
    tokens: int = 0             # tokens written (eod included)
    lines: int = 0              # lines read
    skipped_bad: int = 0        # bad lines skipped (skip_bad)
    empty: int = 0              # lines whose text tokenized to nothing (not written)
    dtype: str = ""
    skipped_existing: bool = False  # the prefix was already complete; nothing was done
    seconds: float = 0.0
    reasons: Optional[Dict[str, int]] = None  # skipped bad lines by reason
    first_error: Optional[str] = None         # the first skipped line's message


def token_dtype_for_vocab(vocab_size: int):
    """uint16 when every id fits (vocab <= 65536), else int32 (what GPTDatasetConfig expects too)."""
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32


def prefix_is_complete(prefix: str) -> bool:
    """Both PREFIX.bin and PREFIX.idx exist (they are only ever renamed into place when complete)."""
    return os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")


def _tmp_paths(prefix: str) -> Tuple[str, str]:
    tag = f".tmp-{os.getpid()}"
    return prefix + tag + ".bin", prefix + tag + ".idx"


def _remove_stale_tmp(prefix: str) -> None:
    """Delete temporary files of earlier runs on this prefix that were killed (their process is gone)."""
    for path in glob.glob(glob.escape(prefix) + ".tmp-*.bin") + glob.glob(glob.escape(prefix) + ".tmp-*.idx"):
        try:
            pid = int(path.rsplit(".tmp-", 1)[1].split(".")[0])
        except ValueError:
            continue
        if pid == os.getpid() or not _pid_alive(pid):
            try:
                os.remove(path)
            except OSError:
                pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# worker state (one tokenizer per process)
_W: Dict[str, Any] = {}


def _worker_init(tokenizer_spec, json_key: str, append_eod: bool, path: str) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _W["tok"] = load_tokenizer(tokenizer_spec)
    _W["key"] = json_key
    _W["eod"] = append_eod
    _W["path"] = path


def _encode_batch(batch: List[Tuple[int, bytes]]) -> List[Tuple[int, Optional[np.ndarray], Optional[str], str]]:
    """(line_no, ids | None, error message | None, reason) for each line of a batch."""
    tok, key, eod, path = _W["tok"], _W["key"], _W["eod"], _W["path"]
    out = []
    for line_no, raw in batch:
        if isinstance(raw, tuple):  # refused unread by _read_batches: (message, reason)
            out.append((line_no, None, raw[0], raw[1]))
            continue
        try:
            obj = parse_jsonl_line(raw, path, line_no, required={key: str})
        except DataError as e:
            out.append((line_no, None, str(e), e.reason))
            continue
        ids = tok.encode(obj[key])
        if eod and ids:
            ids.append(tok.eod_id)
        out.append((line_no, np.asarray(ids, dtype=np.int64), None, ""))
    return out


class _ReadAhead:
    """Bounds how many batches a pool's feeder thread reads ahead of the writer; ``stop()`` unblocks it."""

    def __init__(self, limit: int):
        self._slots = threading.Semaphore(limit)
        self._stop = threading.Event()

    def acquire(self) -> bool:
        while not self._slots.acquire(timeout=0.05):
            if self._stop.is_set():
                return False
        return not self._stop.is_set()

    def release(self) -> None:
        self._slots.release()

    def stop(self) -> None:
        self._stop.set()


def _read_batches(path: str, stats: JsonlStats, read_ahead: Optional[_ReadAhead] = None,
                  max_sample_bytes: int = MAX_SAMPLE_BYTES) -> Iterator[List[Tuple[int, Any]]]:
    """Batches of (line_no, raw line), blank lines left out; a line over ``max_sample_bytes`` comes unread, as
    (line_no, (its error message, reason))."""
    batch: List[Tuple[int, Any]] = []
    with open(path, "rb") as f:
        for line_no, raw in iter_raw_lines(f, max_sample_bytes):
            stats.lines += 1
            if isinstance(raw, int):
                stats.bytes += raw
                err = too_long_error(path, line_no, raw, max_sample_bytes)
                raw = (str(err), err.reason)
            else:
                stats.bytes += len(raw)
            if isinstance(raw, bytes) and not raw.strip():
                stats.blank += 1
                continue
            batch.append((line_no, raw))
            if len(batch) >= _BATCH_LINES:
                if read_ahead is not None and not read_ahead.acquire():
                    return
                yield batch
                batch = []
    if batch and (read_ahead is None or read_ahead.acquire()):
        yield batch


def _count_lines(path: str) -> int:
    n = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            n += block.count(b"\n")
    return n


def _write_document(builder, ids: np.ndarray) -> None:
    builder.add_document(ids, [len(ids)])


class _ProgressLines:
    """Progress as log lines every ``interval`` seconds (when the output is not a terminal, where a bar would be
    one unreadable line): documents written, bytes read of the file's size, documents per second."""

    def __init__(self, name: str, total_bytes: int, interval: float):
        self.name, self.total, self.interval = name, total_bytes, interval
        self.t0 = self.last = time.time()

    def update(self, documents: int, bytes_read: int, final: bool = False) -> None:
        now = time.time()
        if not final and now - self.last < self.interval:
            return
        self.last = now
        rate = documents / max(now - self.t0, 1e-9)
        share = f" ({100 * bytes_read / self.total:.0f}%)" if self.total else ""
        logger.info("%s: %d documents, %s of %s read%s, %.0f docs/s", self.name, documents, _size(bytes_read),
                    _size(self.total), share, rate)


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def preprocess_jsonl(input_path: Union[str, os.PathLike], output_prefix: Union[str, os.PathLike],
                     tokenizer: TokenizerLike = None, json_key: str = "text", workers: int = 1,
                     append_eod: bool = False, skip_bad: bool = False, overwrite: bool = False,
                     progress: Optional[bool] = None, progress_interval: float = 5.0,
                     max_sample_bytes: int = MAX_SAMPLE_BYTES) -> PreprocessResult:
    """Tokenize ``input_path`` (one document per line, text under ``json_key``) into ``output_prefix``.bin/.idx.

    ``tokenizer``: a :class:`GLM5Tokenizer` or anything :func:`load_tokenizer` takes (workers reload it from
    its path).  ``workers`` > 1 tokenizes in a multiprocessing pool.  ``append_eod`` ends each document with the
    eod token.  ``skip_bad`` counts and skips bad lines instead of raising :class:`DataError` ``file:line: ...``.
    ``max_sample_bytes``: a longer line is a bad line, never decoded.  ``overwrite`` rebuilds a complete prefix
    (otherwise it is skipped).  ``progress``: a tqdm bar when stderr is a terminal, else a log line every
    ``progress_interval`` seconds (default: on; False: none; True: the bar).
    """
    t0 = time.time()
    input_path = check_jsonl_path(input_path)
    prefix = os.fspath(output_prefix)
    result = PreprocessResult(prefix=prefix)
    if prefix_is_complete(prefix) and not overwrite:
        logger.info("%s.bin/.idx exist: skipping %s (pass overwrite=True / --overwrite to rebuild)", prefix, input_path)
        result.skipped_existing = True
        return result
    tok = load_tokenizer(tokenizer)
    dtype = token_dtype_for_vocab(tok.vocab_size)
    result.dtype = np.dtype(dtype).name
    out_dir = os.path.dirname(os.path.abspath(prefix))
    os.makedirs(out_dir, exist_ok=True)
    _remove_stale_tmp(prefix)
    tmp_bin, tmp_idx = _tmp_paths(prefix)

    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    stats = JsonlStats(path=input_path)
    lines_out = None
    if progress is None:
        progress = sys.stderr.isatty()
        if not progress:
            lines_out = _ProgressLines(os.path.basename(prefix), os.path.getsize(input_path), progress_interval)
    from tqdm import tqdm

    bar = tqdm(total=_count_lines(input_path) if progress else None, unit="lines", desc=os.path.basename(prefix),
               disable=not progress, dynamic_ncols=True)
    pool = None
    read_ahead = None
    builder = None
    success = False
    try:
        builder = IndexedDatasetBuilder(tmp_bin, dtype=dtype)
        init_args = (tok.name_or_path, json_key, append_eod, input_path)
        read_ahead = _ReadAhead(4 * workers) if workers > 1 else None
        batches = _read_batches(input_path, stats, read_ahead, max_sample_bytes)
        if workers > 1:
            method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
            pool = multiprocessing.get_context(method).Pool(workers, initializer=_worker_init, initargs=init_args)
            results = pool.imap(_encode_batch, batches, chunksize=1)
        else:
            _worker_init(tok, json_key, append_eod, input_path)
            results = map(_encode_batch, batches)
        for batch in results:
            if read_ahead is not None:
                read_ahead.release()
            for line_no, ids, error, reason in batch:
                if error is not None:
                    err = DataError(error, reason)
                    if not skip_bad:
                        raise err
                    stats.count_bad(err)
                    continue
                stats.records += 1
                if len(ids) == 0:
                    result.empty += 1
                    continue
                _write_document(builder, ids)
                result.documents += 1
                result.tokens += int(len(ids))
            bar.update(max(0, batch[-1][0] - bar.n))
            if lines_out is not None:
                lines_out.update(result.documents, stats.bytes)
        if lines_out is not None:
            lines_out.update(result.documents, stats.bytes, final=True)
        result.lines, result.skipped_bad = stats.lines, stats.skipped
        if result.documents == 0:
            why = f"; skipped {stats.skipped} bad lines, first: {stats.errors[0]}" if stats.skipped else ""
            raise DataError(f"{input_path}: no documents to write (lines {stats.lines}, empty texts "
                            f"{result.empty}{why})", "no_records")
        builder.finalize(tmp_idx)
        builder = None
        # old .idx out first, .bin in, .idx in last: a prefix counts as complete only when both exist
        if os.path.exists(prefix + ".idx"):
            os.remove(prefix + ".idx")
        os.replace(tmp_bin, prefix + ".bin")
        os.replace(tmp_idx, prefix + ".idx")
        success = True
    finally:
        bar.close()
        if read_ahead is not None:
            read_ahead.stop()
        if pool is not None:
            if success:
                pool.close()
            else:
                pool.terminate()
            pool.join()
        if builder is not None:
            try:
                builder.data_file.close()
            except Exception:  # noqa: BLE001
                pass
        if not success:
            for p in (tmp_bin, tmp_idx):
                if os.path.exists(p):
                    os.remove(p)
            # a crash between the two renames leaves a lone .bin: remove it so the prefix is not half there
            if os.path.exists(prefix + ".bin") and not os.path.exists(prefix + ".idx"):
                os.remove(prefix + ".bin")
    if stats.skipped:
        logger.warning("%s", stats.summary())
        result.reasons, result.first_error = dict(stats.reasons), stats.errors[0]
        SKIPPED_SAMPLES.add(input_path, stats.reasons, stats.errors[0])
    result.seconds = time.time() - t0
    logger.info("wrote %s.bin/.idx: %d documents, %d tokens (%s), %d bad lines skipped, %d empty, %.1fs", prefix,
                result.documents, result.tokens, result.dtype, result.skipped_bad, result.empty, result.seconds)
    return result
