"""The LoRA flags (--lora-rank, --lora-alpha, --lora-dropout, --lora-target-modules, --train-indexer) and their
checks; arguments.py calls ``add_flags`` and ``check`` (which returns the derived ``lora``: a LoRAConfig or None)."""
from __future__ import annotations

import argparse
from typing import Any, Dict

from megatron_glm5.errors import UserError
from megatron_glm5.lora import targets as lora_targets
from megatron_glm5.lora.config import LoRAConfig


class LoRAFlagError(UserError, ValueError):
    """A bad --lora-* / --train-indexer flag."""


def add_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("LoRA (docs/lora.md)")
    g.add_argument("--lora-rank", type=int, default=None, metavar="R",
                   help="train LoRA adapters of rank R on a frozen base (--load BASE --finetune); default: no LoRA")
    g.add_argument("--lora-alpha", type=float, default=None, metavar="A",
                   help="LoRA scaling numerator: adapters add (A/R) B A x (default: 2 R)")
    g.add_argument("--lora-dropout", type=float, default=0.0, metavar="P",
                   help="dropout on the adapters' input (not on kv_b, which the absorbed attention merges)")
    g.add_argument("--lora-target-modules", default=lora_targets.DEFAULT_TARGETS, metavar="NAMES",
                   help="comma-separated: q_a q_b kv_a kv_b o (attention), gate_up down (dense MLP), shared_gate_up "
                        "shared_down (shared expert), experts_gate_up experts_down (routed experts, grouped), or the "
                        "groups attention, mlp, shared_experts, experts, all (default: all)")
    g.add_argument("--train-indexer", action="store_true",
                   help="with LoRA: train the DSA lightning indexers fully with their KL loss (default: frozen)")


def check(args: argparse.Namespace, derived: Dict[str, Any] = None) -> Dict[str, Any]:
    """{"lora": LoRAConfig or None}; ``derived``: the values derive_args computed before (the resolved --etp)."""
    rank = getattr(args, "lora_rank", None)
    if rank is None:
        if getattr(args, "train_indexer", False):
            raise LoRAFlagError("--train-indexer is for LoRA runs (give --lora-rank); without LoRA the indexer "
                                "trains unless --freeze-indexer")
        return {"lora": None}
    if rank <= 0:
        raise LoRAFlagError(f"--lora-rank must be a positive integer, got {rank}")
    if args.lora_dropout < 0 or args.lora_dropout >= 1:
        raise LoRAFlagError(f"--lora-dropout must be in [0, 1), got {args.lora_dropout:g}")
    alpha = float(args.lora_alpha) if args.lora_alpha is not None else 2.0 * rank
    if alpha <= 0:
        raise LoRAFlagError(f"--lora-alpha must be > 0, got {alpha:g}")
    try:
        names = lora_targets.resolve(str(args.lora_target_modules).split(","))
    except KeyError as e:
        raise LoRAFlagError(f"--lora-target-modules: unknown module {e.args[0]!r}; valid: "
                            f"{', '.join(lora_targets.valid_names())}") from None
    if not names:
        raise LoRAFlagError("--lora-target-modules is empty; name at least one module (e.g. attention)")
    if args.train_indexer and args.freeze_indexer:
        raise LoRAFlagError("--train-indexer and --freeze-indexer contradict each other: choose one")
    if args.dsa_stage == "dense-warmup":
        raise LoRAFlagError("--lora-rank with --dsa-stage dense-warmup: the warm-up trains the indexers alone; "
                            "run LoRA in the sparse stage")
    etp = (derived or {}).get("expert_tensor_parallel_size") or getattr(args, "expert_tensor_parallel_size", None) or 1
    if etp > 1 and any(n.startswith("experts_") for n in names):
        raise LoRAFlagError(f"--etp {etp} with LoRA on the routed experts is not supported; use --etp 1 (experts "
                            "are sharded by --ep) or leave experts out of --lora-target-modules")
    return {"lora": LoRAConfig(rank=rank, alpha=alpha, dropout=float(args.lora_dropout), targets=names,
                               train_indexer=bool(args.train_indexer))}


def freezes_indexer(args) -> bool:
    """A LoRA run keeps the indexers as loaded (and skips their KL loss) unless --train-indexer."""
    lora = getattr(args, "lora", None)
    return lora is not None and not lora.train_indexer


def keeps_router_bias(args) -> bool:
    """A LoRA run keeps the routers' expert bias (the base's balancing state) as loaded."""
    return getattr(args, "lora", None) is not None
