"""Adapter-only checkpoints: the trainable tensors (adapters, and the indexers with --train-indexer), their
optimizer state, the LR schedule, RNG and data position -- megabytes to a few GB -- and the base they belong to.

The base stays where it is (``--load BASE``, weights only). A chunk's ``checkpoint_scope`` (set by apply.py)
narrows what training/checkpointing.py saves and loads for it: "adapters" (saves and resumes) or "base" (the
base's weights, the adapters left as drawn). The common state carries under ``glm5_lora`` the LoRA config and the
base's model fingerprint (checkpoint/format.py); resuming onto another base, or with other --lora-* flags, is one
line. Start: ``--load BASE --finetune --lora-rank R``; continue: the same with ``--resume`` in place of
``--finetune`` (without --load, the base recorded in the adapter checkpoint).
"""
from __future__ import annotations

import copy
import logging
import os

from megatron_glm5.errors import UserError
from megatron_glm5.lora.config import LoRAConfig

log = logging.getLogger("megatron_glm5.lora")
COMMON_KEY = "glm5_lora"


class LoRACheckpointError(UserError):
    """An adapter checkpoint that does not belong to this base or these --lora-* flags."""


class AdapterScope:
    """What a LoRA model chunk's checkpoints hold: ``mode`` "adapters" (the trainable tensors) or "base"."""

    def __init__(self, cfg: LoRAConfig, trainable: set, mtp: bool = False):
        self.cfg, self.trainable, self.mode, self.mtp = cfg, set(trainable), "adapters", bool(mtp)
        self.base_record = {}

    @staticmethod
    def is_adapter(key: str) -> bool:
        return key.rsplit(".", 1)[-1].startswith("lora_")

    def view(self, sharded_state_dict: dict) -> dict:
        return {k: v for k, v in sharded_state_dict.items() if not self.excludes(k)}

    def excludes(self, key: str) -> bool:
        return key not in self.trainable if self.mode == "adapters" else self.is_adapter(key)

    def annotate(self, state: dict, record_key: str) -> None:
        """Add to a checkpoint's state the LoRA record; the model record says whether the model has its MTP layer
        (an adapter checkpoint holds none of its tensors, from which a reader would otherwise conclude it has not)."""
        if self.mode != "adapters":
            return
        state[COMMON_KEY] = {"lora": self.cfg.to_record(), "base": dict(self.base_record)}
        state[record_key]["mtp"] = self.mtp


def _set_mode(chunks, mode: str) -> None:
    for m in chunks:
        m.checkpoint_scope.mode = mode


def read_lora_record(path: str):
    """(checkpoint dir, its glm5_lora record or None) of a --save root or iteration directory (collective)."""
    from megatron.core import dist_checkpointing

    from megatron_glm5.training.checkpointing import resolve_load_dir

    resolved, _ = resolve_load_dir(path)
    return resolved, dist_checkpointing.load_common_state_dict(resolved).get(COMMON_KEY)


def check_belongs(record: dict, path: str, cfg: LoRAConfig, fingerprint: str, base: str) -> None:
    saved_fp = record["base"].get("model_fingerprint")
    if saved_fp is not None and saved_fp != fingerprint:
        raise LoRACheckpointError(
            f"{path}: these adapters were trained on the base with model fingerprint {saved_fp} "
            f"({record['base'].get('checkpoint')}), but {base} has {fingerprint}; load them with their own base")
    saved = LoRAConfig.from_record(record["lora"])
    for field, flag in (("rank", "--lora-rank"), ("alpha", "--lora-alpha"), ("targets", "--lora-target-modules"),
                        ("train_indexer", "--train-indexer")):
        if getattr(saved, field) != getattr(cfg, field):
            raise LoRACheckpointError(f"{flag} {getattr(cfg, field)!r} but the adapter checkpoint {path} was trained "
                                      f"with {getattr(saved, field)!r}: resume with the checkpoint's value")


def load(args, chunks, optimizer, scheduler) -> dict:
    """The LoRA run's start: the base's weights from --load, then (with --resume) the adapters, optimizer,
    schedule, RNG and data position from this run's checkpoint. Returns {"iteration", "data_state"}."""
    from megatron_glm5.checkpoint.format import model_fingerprint
    from megatron_glm5.training import checkpointing

    cfg = args.lora
    adapter_dir, record = None, None
    continued = bool(args.load and args.save and os.path.realpath(args.load) == os.path.realpath(args.save))
    if (getattr(args, "resume", False) or continued) and args.save and os.path.isdir(args.save):
        adapter_dir, record = read_lora_record(args.save)
        if record is None:
            raise LoRACheckpointError(f"--resume: {adapter_dir} is not a LoRA adapter checkpoint (no {COMMON_KEY} "
                                      "record); resume it without --lora-rank, or start a LoRA run with --finetune")
    base = args.load
    if base and adapter_dir and os.path.realpath(base) in (os.path.realpath(args.save), os.path.realpath(adapter_dir)):
        base = record["base"].get("checkpoint")  # --resume without --load: the base this run recorded
    fingerprint = model_fingerprint(args.model_config)
    for m in chunks:
        m.checkpoint_scope.base_record = {"model_fingerprint": fingerprint,
                                          "checkpoint": os.path.realpath(base) if base else None}
    if not base and args.load:  # a run from --seed's base: build_model_chunks saw --load and drew nothing
        from megatron_glm5.model.init import initialize_by_global_identity
        for m in chunks:
            initialize_by_global_identity(m, args.seed)
    if base:
        _set_mode(chunks, "base")
        weights_only = copy.copy(args)
        weights_only.finetune, weights_only.resume = True, False
        checkpointing.load_checkpoint(base, chunks, optimizer, scheduler, weights_only)
    resumed = {"iteration": 0, "data_state": {}}
    _set_mode(chunks, "adapters")
    if adapter_dir is not None:
        check_belongs(record, adapter_dir, cfg, fingerprint, base or "this model")
        resumed = checkpointing.load_checkpoint(adapter_dir, chunks, optimizer, scheduler, args)
    return resumed
