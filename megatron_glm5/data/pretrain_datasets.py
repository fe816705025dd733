"""Pretraining datasets: (blended) megatron-core GPTDataset splits over preprocessed prefixes.

::

    train, valid, test = build_pretrain_datasets([("data/a", 0.8), ("data/b", 0.2)], "98,1,1", seq_length=4096,
                                                 num_samples=(100_000, 1_000, 1_000), tokenizer=tok)

returns megatron-core ``GPTDataset`` (one prefix) or ``BlendedDataset`` (several) splits whose samples hold
``tokens``, ``labels``, ``loss_mask``, ``position_ids`` (and ``dataset_id`` from a blend).  A ``.jsonl`` file may
stand in for a prefix: it is preprocessed once into a cache (index_cache.py).  Works in one process without
``torch.distributed`` and in a process group (rank 0 builds the index caches first).  The other steps, each in
its module: preprocess.py (jsonl -> .bin/.idx), index_cache.py, blend.py, dataset_helpers.py (megatron-core's
C++ helpers).
"""
from __future__ import annotations

import os
import warnings
from typing import Callable, Optional, Sequence

from megatron_glm5.data.blend import Blend, normalize_blend
from megatron_glm5.data.dataset_helpers import ensure_helpers
from megatron_glm5.data.index_cache import ensure_indexed
from megatron_glm5.data.indexed_check import check_indexed_prefix
from megatron_glm5.data.jsonl import MAX_SAMPLE_BYTES, DataError
from megatron_glm5.data.tokenizer import TokenizerLike, load_tokenizer

__all__ = ["build_pretrain_datasets"]


def _always_build() -> bool:
    return True


def build_pretrain_datasets(prefixes_with_weights: Blend, split: Optional[str] = "98,1,1", *, seq_length: int,
                            num_samples: Sequence[Optional[int]], seed: int = 1234, tokenizer: TokenizerLike = None,
                            cache_dir: Optional[str] = None, is_built_on_rank: Optional[Callable[[], bool]] = None,
                            eod_mask_loss: bool = False, reset_position_ids: bool = False,
                            reset_attention_mask: bool = False, create_attention_mask: bool = False,
                            num_dataset_builder_threads: int = 1, mid_level_dataset_surplus: float = 0.005,
                            skip_bad: bool = False, max_sample_bytes: int = MAX_SAMPLE_BYTES):
    """Train/valid/test datasets (each ``None`` where its split is 0 or its sample count is 0) over a blend of
    preprocessed prefixes.

    ``prefixes_with_weights``: see :func:`normalize_blend`; weights set the share of samples drawn from each
    prefix (without weights, shares follow dataset sizes).  A ``.jsonl`` file in place of a prefix is
    preprocessed first (:func:`ensure_indexed`, into ``cache_dir/indexed``; ``skip_bad`` skips and counts its bad
    lines instead of raising :class:`DataError` ``file:line: ...``).  ``split``: e.g. ``"98,1,1"``, applied to the
    documents of every prefix; a split that gets no document of some prefix is refused (:class:`DataError` naming
    --split and the counts; megatron-core would loop forever on it).  ``num_samples``: ``(train, valid, test)``
    sample counts (``None`` = one epoch; weights need counts; 0 = that split is not built).  Every prefix's
    ``.idx``/``.bin`` is checked first (:func:`check_indexed_prefix`).  ``max_sample_bytes``: see
    :func:`ensure_indexed`.  ``tokenizer``: gives the eod id and vocabulary size.  ``cache_dir``: where the index caches go
    (default ``<prefix dir>/cache``).  ``is_built_on_rank``: megatron's callable (default: every rank builds;
    rank 0 first when torch.distributed is initialised).  Samples are dicts of torch tensors ``tokens``,
    ``labels``, ``loss_mask``, ``position_ids`` [seq_length] (+ ``attention_mask`` if ``create_attention_mask``,
    + ``dataset_id`` from a blend).
    """
    ensure_helpers()
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    sources, weights = normalize_blend(prefixes_with_weights)
    tok = load_tokenizer(tokenizer)
    prefixes = [ensure_indexed(p, tok, cache_dir=os.path.join(cache_dir, "indexed") if cache_dir else None,
                               skip_bad=skip_bad, max_sample_bytes=max_sample_bytes) for p in sources]
    for p in prefixes:
        if not IndexedDataset.exists(p):
            raise DataError(f"{p}: no indexed dataset {p}.bin/{p}.idx; build it with tools/preprocess_data.py "
                            f"--output-prefix {p}", "missing_file")
    sizes = [check_indexed_prefix(p).sequences for p in prefixes]
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
        shares = list(config.split_matrix)
        for i, n in enumerate(num_samples):
            if n == 0:  # not wanted: not built (an empty split that is not used is no error)
                config.split_matrix[i] = None
        _check_splits_not_empty(split, shares, config.split_matrix, sources, sizes)
        builder = BlendedMegatronDatasetBuilder(GPTDataset, num_samples, is_built_on_rank or _always_build, config)
        train, valid, test = builder.build()
    return train, valid, test


_SPLIT_NAMES = ("train", "valid", "test")


def _check_splits_not_empty(split: str, shares, built, sources: Sequence[str], sizes: Sequence[int]) -> None:
    """Every split that is ``built`` gets at least one document of every prefix (megatron-core's GPTDataset loops
    forever in _get_num_epochs over an empty one).  ``shares``: the split matrix of --split; the document ranges
    are megatron-core's own rounding of it."""
    for source, n in zip(sources, sizes):
        counts = [0 if b is None else int(round(b[1] * float(n))) - int(round(b[0] * float(n))) for b in shares]
        empty = [name for name, b, c in zip(_SPLIT_NAMES, built, counts) if b is not None and c <= 0]
        if empty:
            given = ", ".join(f"{name} {c}" for name, c in zip(_SPLIT_NAMES, counts))
            fix = {"train": "give the train split a larger share or use more documents",
                   "valid": "give the valid split a larger share (e.g. --split 90,10,0), pass --valid-data-path, or "
                            "--eval-iters 0",
                   "test": "give the test split a larger share or none (e.g. --split 98,2,0)"}[empty[0]]
            raise DataError(f"--split {split}: the {empty[0]} split of {source} is empty: its {n} documents split "
                            f"into {given}; {fix}", "empty_split")
