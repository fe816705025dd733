"""Pretraining data: jsonl -> Megatron indexed dataset (.bin/.idx) -> (blended) GPTDataset splits.

Preprocess (also ``tools/preprocess_data.py``)::

    preprocess_jsonl("corpus.jsonl", "data/corpus", tokenizer="path/to/tokenizer", workers=8, append_eod=True)

writes ``data/corpus.bin`` and ``data/corpus.idx`` (one document per jsonl line, dtype uint16 when the vocabulary
fits, else int32) with ``megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder``.  The files are written
under temporary names and renamed when complete, so an interrupted run leaves no ``PREFIX.bin``/``PREFIX.idx``;
a prefix whose files exist is skipped unless ``overwrite=True`` (so a list of inputs can be re-run after a crash).

Datasets::

    train, valid, test = build_pretrain_datasets([("data/a", 0.8), ("data/b", 0.2)], "98,1,1", seq_length=4096,
                                                 num_samples=(100_000, 1_000, 1_000), tokenizer=tok)

returns megatron-core ``GPTDataset`` (one prefix) or ``BlendedDataset`` (several) splits whose samples hold
``tokens``, ``labels``, ``loss_mask``, ``position_ids`` (and ``dataset_id`` from a blend).  A ``.jsonl`` file may
stand in for a prefix: :func:`ensure_indexed` preprocesses it once into a cache.  Works in one process
without ``torch.distributed`` and in a process group (rank 0 builds the index caches first).
"""
from __future__ import annotations

import glob
import logging
import multiprocessing
import os
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from megatron_glm5.data.jsonl import SKIPPED_SAMPLES, DataError, JsonlStats, check_jsonl_path, parse_jsonl_line
from megatron_glm5.data.tokenizer import GLM5Tokenizer, load_tokenizer

__all__ = [
    "PreprocessResult",
    "preprocess_jsonl",
    "prefix_is_complete",
    "token_dtype_for_vocab",
    "normalize_blend",
    "build_pretrain_datasets",
    "ensure_helpers",
    "ensure_indexed",
    "default_index_cache_dir",
]

logger = logging.getLogger(__name__)

TokenizerLike = Union[GLM5Tokenizer, str, os.PathLike, None]
_BATCH_LINES = 256


# ---------------------------------------------------------------------------------------------------- helpers_cpp

def ensure_helpers():
    """Import megatron-core's compiled dataset helpers (``megatron.core.datasets.helpers_cpp``), building them if needed.

    The megatron-core wheel ships ``helpers_cpp.*.so``.  A source checkout builds it with ``make`` (its Makefile
    compiles ``helpers.cpp`` with g++ and pybind11) via ``megatron.core.datasets.utils.compile_helpers``; the wheel
    has no Makefile, so when the .so is missing we run the same compile ourselves into a user cache directory.
    """
    import importlib

    try:
        return importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError as first_error:
        err = first_error
    import megatron.core.datasets as mds

    pkg_dir = os.path.dirname(mds.__file__)
    if os.path.isfile(os.path.join(pkg_dir, "Makefile")) and os.access(pkg_dir, os.W_OK):
        from megatron.core.datasets.utils import compile_helpers

        compile_helpers()
        return importlib.import_module("megatron.core.datasets.helpers_cpp")
    return _compile_helpers_into_cache(os.path.join(pkg_dir, "helpers.cpp"), err)


def _compile_helpers_into_cache(source: str, import_error: Exception):
    import importlib.machinery
    import importlib.util
    import shutil
    import subprocess
    import sysconfig

    if not os.path.isfile(source):
        raise ImportError(f"megatron.core.datasets.helpers_cpp is missing and so is its source {source}; "
                          f"reinstall megatron-core") from import_error
    try:
        import pybind11
    except ImportError:
        raise ImportError("megatron.core.datasets.helpers_cpp is not built and pybind11 is missing to build it: "
                          "`pip install pybind11` (and have g++), or reinstall the megatron-core wheel") from import_error
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise ImportError("megatron.core.datasets.helpers_cpp is not built and no C++ compiler (g++) was found")
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "megatron_glm5",
                         "helpers", f"{os.path.getmtime(source):.0f}")
    os.makedirs(cache, exist_ok=True)
    target = os.path.join(cache, "helpers_cpp" + suffix)
    if not os.path.isfile(target):
        tmp = f"{target}.{os.getpid()}.tmp"
        cmd = [cxx, "-O3", "-Wall", "-shared", "-std=c++11", "-fPIC", f"-I{pybind11.get_include()}",
               f"-I{sysconfig.get_paths()['include']}", source, "-o", tmp]
        logger.info("building megatron-core dataset helpers: %s", " ".join(cmd))
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise ImportError(f"building megatron.core.datasets.helpers_cpp failed:\n{res.stderr[-2000:]}")
        os.replace(tmp, target)
    spec = importlib.util.spec_from_file_location("megatron.core.datasets.helpers_cpp", target)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["megatron.core.datasets.helpers_cpp"] = module
    import megatron.core.datasets as mds

    mds.helpers_cpp = module
    return module


# ---------------------------------------------------------------------------------------------------- preprocessing

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


def _read_batches(path: str, stats: JsonlStats, read_ahead: Optional[_ReadAhead] = None
                  ) -> Iterator[List[Tuple[int, bytes]]]:
    """Batches of (line_no, raw line), blank lines left out."""
    batch: List[Tuple[int, bytes]] = []
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            stats.lines += 1
            if not raw.strip():
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


def preprocess_jsonl(input_path: Union[str, os.PathLike], output_prefix: Union[str, os.PathLike],
                     tokenizer: TokenizerLike = None, json_key: str = "text", workers: int = 1,
                     append_eod: bool = False, skip_bad: bool = False, overwrite: bool = False,
                     progress: Optional[bool] = None) -> PreprocessResult:
    """Tokenize ``input_path`` (one document per line, text under ``json_key``) into ``output_prefix``.bin/.idx.

    ``tokenizer``: a :class:`GLM5Tokenizer` or anything :func:`load_tokenizer` takes (workers reload it from
    its path).  ``workers`` > 1 tokenizes in a multiprocessing pool.  ``append_eod`` ends each document with the
    eod token.  ``skip_bad`` counts and skips bad lines instead of raising :class:`DataError` ``file:line: ...``.
    ``overwrite`` rebuilds a complete prefix (otherwise it is skipped).  ``progress``: tqdm bar (default: when
    stderr is a terminal).
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
    if progress is None:
        progress = sys.stderr.isatty()
    from tqdm import tqdm

    bar = tqdm(total=_count_lines(input_path), unit="lines", desc=os.path.basename(prefix), disable=not progress,
               dynamic_ncols=True)
    pool = None
    read_ahead = None
    builder = None
    success = False
    try:
        builder = IndexedDatasetBuilder(tmp_bin, dtype=dtype)
        init_args = (tok.name_or_path, json_key, append_eod, input_path)
        read_ahead = _ReadAhead(4 * workers) if workers > 1 else None
        batches = _read_batches(input_path, stats, read_ahead)
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


def default_index_cache_dir() -> str:
    """Where :func:`ensure_indexed` puts prefixes built from jsonl files when no cache_dir is given."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "megatron_glm5", "indexed")


def ensure_indexed(path_or_prefix: Union[str, os.PathLike], tokenizer: TokenizerLike = None,
                   cache_dir: Optional[str] = None, json_key: str = "text", workers: int = 1,
                   skip_bad: bool = False) -> str:
    """A Megatron prefix for ``path_or_prefix``: a prefix is returned as is; a ``.jsonl`` file is preprocessed once
    (documents end with eod) into ``cache_dir`` (default :func:`default_index_cache_dir`) under a name keyed by the
    file's path, size, mtime, the tokenizer, ``json_key`` and ``skip_bad``, and later calls reuse it (the bad
    lines skipped when it was built are kept beside it, in ``PREFIX.skipped.json``, and reported again).

    In a torch.distributed process group, rank 0 builds first and the other ranks wait (call it on every rank);
    across nodes ``cache_dir`` must be on a shared file system (as megatron's index caches must), or preprocess
    with tools/preprocess_data.py beforehand.
    """
    import hashlib
    import json as _json

    path = os.fspath(path_or_prefix)
    if not path.endswith(".jsonl"):
        return path
    path = check_jsonl_path(path)
    tok = load_tokenizer(tokenizer)
    st = os.stat(path)
    ident = tok.megatron_tokenizer().unique_identifiers
    key = [os.path.abspath(path), st.st_size, int(st.st_mtime), dict(ident), json_key]
    key = _json.dumps(key + (["skip_bad"] if skip_bad else []), sort_keys=True)
    digest = hashlib.md5(key.encode("utf-8"), usedforsecurity=False).hexdigest()[:12]
    stem = os.path.splitext(os.path.basename(path))[0]
    prefix = os.path.join(cache_dir or default_index_cache_dir(), f"{stem}-{digest}")

    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    error: Optional[BaseException] = None
    if rank == 0:
        try:
            result = preprocess_jsonl(path, prefix, tok, json_key=json_key, workers=workers, append_eod=True,
                                      skip_bad=skip_bad, progress=False)
            _remember_skipped(path, prefix + ".skipped.json", result)
        except BaseException as e:  # noqa: BLE001 - re-raised after the barrier so other ranks do not hang
            error = e
    if distributed:
        dist.barrier()
        if rank != 0 and not prefix_is_complete(prefix):
            raise DataError(f"{path}: rank 0 failed to preprocess it into {prefix} (see rank 0's error)", "no_records")
    if error is not None:
        raise error
    return prefix


def _remember_skipped(path: str, sidecar: str, result: PreprocessResult) -> None:
    """Keep the skipped-line counts of a cached prefix beside it; on reuse, count them again."""
    import json as _json

    if not result.skipped_existing:
        if result.reasons:
            with open(sidecar, "w", encoding="utf-8") as f:
                _json.dump({"reasons": result.reasons, "first_error": result.first_error}, f)
        return
    if os.path.isfile(sidecar):
        with open(sidecar, encoding="utf-8") as f:
            saved = _json.load(f)
        logger.warning("%s: its cached index was built skipping %d bad lines", path, sum(saved["reasons"].values()))
        SKIPPED_SAMPLES.add(path, saved["reasons"], saved.get("first_error"))


# ---------------------------------------------------------------------------------------------------- datasets

Blend = Union[str, Sequence[Union[str, Tuple[str, float], Tuple[float, str]]], Dict[str, float]]


def normalize_blend(prefixes_with_weights: Blend) -> Tuple[List[str], Optional[List[float]]]:
    """``(prefixes, weights or None)`` from any of: ``"prefix"``; ``["p1", "p2"]``; ``[("p1", 0.8), ("p2", 0.2)]``
    (or ``(weight, prefix)`` pairs); ``{"p1": 0.8, "p2": 0.2}``; Megatron's flat ``["0.8", "p1", "0.2", "p2"]``."""
    spec = prefixes_with_weights
    if isinstance(spec, (str, os.PathLike)):
        return [os.fspath(spec)], None
    if isinstance(spec, dict):
        items = list(spec.items())
    else:
        items = list(spec)
    if not items:
        raise ValueError("empty dataset blend: give at least one data prefix")
    if all(isinstance(x, (str, os.PathLike)) for x in items):
        flat = [os.fspath(x) for x in items]
        if len(flat) % 2 == 0 and all(_is_number(flat[i]) for i in range(0, len(flat), 2)):
            prefixes, weights = flat[1::2], [float(w) for w in flat[0::2]]
        else:
            return flat, None
    else:
        prefixes, weights = [], []
        for item in items:
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise ValueError(f"blend entry {item!r}: expected (prefix, weight)")
            a, b = item
            if isinstance(a, (int, float)) and not isinstance(b, (int, float)):
                a, b = b, a
            prefixes.append(os.fspath(a))
            weights.append(float(b))
    for p, w in zip(prefixes, weights):
        if not w > 0:
            raise ValueError(f"blend weight of {p!r} must be > 0, got {w}")
    if len(prefixes) == 1:
        weights = None
    return prefixes, weights


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def _always_build() -> bool:
    return True


def build_pretrain_datasets(prefixes_with_weights: Blend, split: Optional[str] = "98,1,1", *, seq_length: int,
                            num_samples: Sequence[Optional[int]], seed: int = 1234, tokenizer: TokenizerLike = None,
                            cache_dir: Optional[str] = None, is_built_on_rank: Optional[Callable[[], bool]] = None,
                            eod_mask_loss: bool = False, reset_position_ids: bool = False,
                            reset_attention_mask: bool = False, create_attention_mask: bool = False,
                            num_dataset_builder_threads: int = 1, mid_level_dataset_surplus: float = 0.005,
                            skip_bad: bool = False):
    """Train/valid/test datasets (each ``None`` where its split is 0) over a blend of preprocessed prefixes.

    ``prefixes_with_weights``: see :func:`normalize_blend`; weights set the share of samples drawn from each
    prefix (without weights, shares follow dataset sizes).  A ``.jsonl`` file in place of a prefix is
    preprocessed first (:func:`ensure_indexed`, into ``cache_dir/indexed``; ``skip_bad`` skips and counts its bad
    lines instead of raising :class:`DataError` ``file:line: ...``).  ``split``: e.g. ``"98,1,1"``, applied to the
    documents of every prefix.  ``num_samples``: ``(train, valid, test)`` sample counts (``None`` = one epoch; weights need
    counts).  ``tokenizer``: gives the eod id and vocabulary size.  ``cache_dir``: where the index caches go
    (default ``<prefix dir>/cache``).  ``is_built_on_rank``: megatron's callable (default: every rank builds;
    rank 0 first when torch.distributed is initialised).  Samples are dicts of torch tensors ``tokens``,
    ``labels``, ``loss_mask``, ``position_ids`` [seq_length] (+ ``attention_mask`` if ``create_attention_mask``,
    + ``dataset_id`` from a blend).
    """
    ensure_helpers()
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefixes, weights = normalize_blend(prefixes_with_weights)
    tok = load_tokenizer(tokenizer)
    prefixes = [ensure_indexed(p, tok, cache_dir=os.path.join(cache_dir, "indexed") if cache_dir else None,
                               skip_bad=skip_bad) for p in prefixes]
    for p in prefixes:
        if not IndexedDataset.exists(p):
            raise DataError(f"{p}: no indexed dataset {p}.bin/{p}.idx; build it with tools/preprocess_data.py "
                            f"--output-prefix {p}", "missing_file")
    num_samples = list(num_samples)
    if len(num_samples) != 3:
        raise ValueError(f"num_samples must be (train, valid, test), got {num_samples!r}")
    with warnings.catch_warnings():
        # megatron's log_single_rank warns in a single process without torch.distributed or RANK: that is fine here
        warnings.filterwarnings("ignore", message="Could not determine rank")
        config = GPTDatasetConfig(
            random_seed=seed,
            sequence_length=seq_length,
            blend=(prefixes, weights),
            split=split,
            path_to_cache=cache_dir,
            tokenizer=tok.megatron_tokenizer(),
            reset_position_ids=reset_position_ids,
            reset_attention_mask=reset_attention_mask,
            eod_mask_loss=eod_mask_loss,
            create_attention_mask=create_attention_mask,
            num_dataset_builder_threads=num_dataset_builder_threads,
            mid_level_dataset_surplus=mid_level_dataset_surplus,
        )
        builder = BlendedMegatronDatasetBuilder(GPTDataset, num_samples, is_built_on_rank or _always_build, config)
        train, valid, test = builder.build()
    return train, valid, test
