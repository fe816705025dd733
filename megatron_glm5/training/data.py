"""Training and validation micro-batch streams: deterministic, sharded over data-parallel ranks, resumable.

A stream walks an endless sequence of global sample indices (shuffled per epoch with the run's seed); each
micro-batch step consumes ``micro_batch_size * dp`` samples and this rank takes its slice. ``consumed`` (stored
in checkpoints) is the only state, so a resumed run sees exactly the samples the uninterrupted run would have.
Context-parallel ranks of one data-parallel replica read the same micro-batches; ``batch_for_this_cp_rank``
(called by the forward step) keeps each rank's share of the sequence.
"""
from __future__ import annotations

import logging
import os

import numpy as np
import torch

from megatron_glm5.data.jsonl import DataError

log = logging.getLogger("megatron_glm5.data")


class MicroBatchStream:
    def __init__(self, samples, collate, micro_batch_size: int, dp_rank: int, dp_size: int, seed: int,
                 consumed: int = 0, shuffle: bool = True):
        if len(samples) == 0:
            raise DataError("dataset is empty", "no_records")
        self.samples, self.collate = samples, collate
        self.mbs, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.seed, self.shuffle, self.consumed = seed, shuffle, consumed
        self._perm_epoch, self._perm = None, None

    def _index(self, g: int) -> int:
        n = len(self.samples)
        epoch, pos = divmod(g, n)
        if not self.shuffle:
            return pos
        if self._perm_epoch != epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(n)
            self._perm_epoch = epoch
        return int(self._perm[pos])

    def __iter__(self):
        return self

    def __next__(self):
        start = self.consumed + self.dp_rank * self.mbs
        batch = self.collate([self.samples[self._index(g)] for g in range(start, start + self.mbs)])
        self.consumed += self.mbs * self.dp_size
        return batch


SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids")  # the [b, s] tensors of a micro-batch


def batch_for_this_cp_rank(batch: dict, cp_size: int = None, cp_rank: int = None) -> dict:
    """This context-parallel rank's share of a micro-batch: every [b, s] tensor split along the sequence into
    2 * cp chunks, chunks r and 2cp-1-r kept (model/context_parallel.py). Position ids keep their global values
    and ``cu_seqlens`` (packed rows) stays global: the attention windows are built from it. Default cp size and
    rank: megatron-core's parallel state."""
    from megatron_glm5.model.context_parallel import split_for_cp_rank

    if cp_size is None:
        from megatron.core import parallel_state as ps
        cp_size, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    if cp_size == 1:
        return batch
    return {k: (split_for_cp_rank(v, cp_size, cp_rank) if k in SEQUENCE_KEYS else v) for k, v in batch.items()}


def _to_device(batch: dict, device) -> dict:
    return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}


def _stack_gpt(samples):
    keys = ("tokens", "labels", "loss_mask", "position_ids")
    return {k: torch.stack([torch.as_tensor(np.asarray(s[k])) for s in samples]) for k in keys}


def check_data_paths(args):
    """Fail fast, before the model is built, on a --data-path / --valid-data-path that names no data (a missing,
    empty or directory .jsonl; a prefix without .bin/.idx). Contents are checked when the datasets are built."""
    from megatron_glm5.arguments import ArgumentError
    from megatron_glm5.data.indexed_check import check_indexed_prefix
    from megatron_glm5.data.jsonl import check_jsonl_path

    for flag, blend in (("--data-path", args.data_blend), ("--valid-data-path", args.valid_data_blend)):
        for path in (blend[0] if blend else []):
            if args.mode == "pretrain" and not path.endswith(".jsonl"):
                if not (os.path.isfile(path + ".bin") and os.path.isfile(path + ".idx")):
                    raise ArgumentError(f"{flag} {path}: neither a .jsonl file nor a Megatron prefix with {path}.bin "
                                        f"and {path}.idx (build those with tools/preprocess_data.py)", flag=flag)
                try:  # a garbage or truncated .idx/.bin
                    check_indexed_prefix(path)
                except DataError as e:
                    raise ArgumentError(f"{flag} {e}", flag=flag) from None
                continue
            try:
                check_jsonl_path(path)
            except DataError as e:
                raise ArgumentError(f"{flag} {e}", flag=flag) from None


def build_streams(args, tokenizer, consumed_train: int = 0):
    """(train stream, valid stream or None) for this rank."""
    from megatron.core import parallel_state as ps

    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    seq = args.seq_length
    if args.mode == "finetune":
        from megatron_glm5.data.packing import collate_padded, concat_packed, pack_sequences
        from megatron_glm5.data.sft import SFTDataset

        def load(paths):
            datasets = [SFTDataset(p, tokenizer, seq, skip_bad=args.skip_bad_samples, overlong=args.overlong,
                                   packed=args.packing, max_sample_bytes=args.max_sample_bytes) for p in paths]
            docs = [d[i] for d in datasets for i in range(len(d))]
            if args.packing:
                return pack_sequences(docs, seq, tokenizer.pad_id), concat_packed
            return docs, lambda rows: collate_padded(rows, seq, tokenizer.pad_id)

        if args.data_blend[1] is not None:
            raise DataError("--data-path: blend weights are for pretraining prefixes; for fine-tuning list the jsonl "
                            "files (every sample is used once per epoch)", "bad_flag")
        train_samples, collate = load(args.data_blend[0])
        valid = None
        if args.valid_data_blend and args.valid_data_blend[0]:
            valid_samples, vcollate = load(args.valid_data_blend[0])
            valid = (valid_samples, vcollate)
        train = MicroBatchStream(train_samples, collate, args.micro_batch_size, dp_rank, dp, args.seed, consumed_train)
        log.info("SFT: %d training %s, %s", len(train_samples), "packed rows" if args.packing else "samples",
                 f"{len(valid[0])} validation" if valid else "no validation")
    else:
        from megatron_glm5.data.pretrain_datasets import build_pretrain_datasets

        gbs = args.global_batch_size
        eval_runs = (args.train_iters // max(args.eval_interval, 1) + 1) * args.eval_iters
        cache = args.data_cache_path or os.path.join(args.save or "runs", "data_cache")

        def blend_of(paths_weights):
            paths, weights = paths_weights
            return list(zip(paths, weights)) if weights else paths

        own_valid = bool(args.valid_data_blend and args.valid_data_blend[0])  # replaces the --split share
        train_ds, valid_ds, _ = build_pretrain_datasets(  # 0 samples: the split is not built (the test split)
            blend_of(args.data_blend), args.split, seq_length=seq, seed=args.seed, tokenizer=tokenizer,
            num_samples=(args.train_iters * gbs, 0 if own_valid else eval_runs * gbs, 0),
            cache_dir=cache, skip_bad=args.skip_bad_samples, max_sample_bytes=args.max_sample_bytes)
        if own_valid:
            _, valid_ds, _ = build_pretrain_datasets(
                blend_of(args.valid_data_blend), "0,100,0", seq_length=seq, seed=args.seed, tokenizer=tokenizer,
                num_samples=(0, eval_runs * gbs, 0), cache_dir=cache, skip_bad=args.skip_bad_samples,
                max_sample_bytes=args.max_sample_bytes)
        train = MicroBatchStream(train_ds, _stack_gpt, args.micro_batch_size, dp_rank, dp, args.seed,
                                 consumed_train, shuffle=False)
        valid = (valid_ds, _stack_gpt) if valid_ds is not None and len(valid_ds) else None
    return train, valid


def valid_stream(valid, args):
    """A fresh pass over the same validation micro-batches (comparable across evaluations)."""
    if valid is None:
        return None
    from megatron.core import parallel_state as ps

    samples, collate = valid
    return MicroBatchStream(samples, collate, args.micro_batch_size, ps.get_data_parallel_rank(),
                            ps.get_data_parallel_world_size(), args.seed, 0, shuffle=False)
