"""The index cache: a ``.jsonl`` file given where a Megatron prefix is expected is preprocessed once into a cache
directory, keyed by the file and the tokenizer, and reused (every rank of a process group; rank 0 builds)."""
from __future__ import annotations

import logging
import os
from typing import Optional, Union

from megatron_glm5.data.cache_root import cache_root
from megatron_glm5.data.jsonl import MAX_SAMPLE_BYTES, SKIPPED_SAMPLES, DataError, check_jsonl_path
from megatron_glm5.data.preprocess import PreprocessResult, prefix_is_complete, preprocess_jsonl
from megatron_glm5.data.tokenizer import TokenizerLike, load_tokenizer

__all__ = ["ensure_indexed", "default_index_cache_dir"]

logger = logging.getLogger(__name__)


def default_index_cache_dir() -> str:
    """Where :func:`ensure_indexed` puts prefixes built from jsonl files when no cache_dir is given."""
    return os.path.join(cache_root(), "indexed")


def ensure_indexed(path_or_prefix: Union[str, os.PathLike], tokenizer: TokenizerLike = None,
                   cache_dir: Optional[str] = None, json_key: str = "text", workers: int = 1,
                   skip_bad: bool = False, max_sample_bytes: int = MAX_SAMPLE_BYTES) -> str:
    """A Megatron prefix for ``path_or_prefix``: a prefix is returned as is; a ``.jsonl`` file is preprocessed once
    (documents end with eod) into ``cache_dir`` (default :func:`default_index_cache_dir`) under a name keyed by the
    file's path, size, mtime, the tokenizer, ``json_key``, ``skip_bad`` and ``max_sample_bytes`` (lines longer are
    bad lines), and later calls reuse it (the bad
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
    key += ["skip_bad"] if skip_bad else []
    key += [f"max_sample_bytes={max_sample_bytes}"] if max_sample_bytes != MAX_SAMPLE_BYTES else []
    key = _json.dumps(key, sort_keys=True)
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
                                      skip_bad=skip_bad, progress=False, max_sample_bytes=max_sample_bytes)
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
