"""``--base-precision``: the flag and its checks (stdlib-only at import: arguments.py stays cheap to import).

``--base-precision fp8`` keeps the large matrices of the base model (attention q_a, q_b, kv_a, kv_b, o; dense and
shared-expert MLPs; routed experts) frozen in float8_e4m3fn with the release's 128x128 block scales
(fp8/modules.py). A frozen base trains nothing by itself, so the run must train something else on it: LoRA
adapters (``--lora-rank``), the indexers alone (``--dsa-stage dense-warmup``), or nothing (``--eval-only``).
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Dict, Optional, Tuple

from megatron_glm5.errors import FlagError

CHOICES = ("bf16", "fp8")
BLOCK = 128  # fp8/blocks.py's (not imported: that module imports torch)
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell


class FP8FlagError(FlagError):
    """--base-precision fp8 with a run it cannot serve (one line naming the flag)."""

    FLAG = "--base-precision"


def add_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("frozen FP8 base")
    g.add_argument("--base-precision", choices=CHOICES, default="bf16",
                   help="fp8: keep the base model's large matrices frozen in FP8 e4m3 with 128x128 block scales, as "
                        "the GLM-5-FP8 release stores them (train LoRA adapters on it, --lora-rank; docs/fp8.md)")


HOLD_WHOLE_LIMIT = 1 << 24  # elements: a linear this small whose shard does not cut on the blocks is held whole


def shard_cuts(width: int, size: int) -> bool:
    """Whether splitting ``width`` rows/columns over ``size`` ranks cuts on the 128-wide scale blocks."""
    return size == 1 or (width % size == 0 and (width // size) % BLOCK == 0)


def held_whole(width: int, numel: int, size: int) -> bool:
    """The rule for a tensor-parallel FP8 linear whose shard does not cut on the blocks: small ones (kv_a_proj's
    576 rows, test models) are held whole on every rank; large ones are refused (:func:`_tp_split_problem`)."""
    return not shard_cuts(width, size) and numel <= HOLD_WHOLE_LIMIT


def _tp_split_problem(cfg, tp: int, etp: int) -> Optional[str]:
    """The first FP8 matrix whose tensor-parallel split does not cut on its 128-wide scale blocks and is too large
    to be held whole on every rank (expert shards always must cut)."""
    h = cfg.hidden_size
    shared = cfg.moe_intermediate_size * max(cfg.n_shared_experts or 0, 1)
    heads = cfg.num_attention_heads
    checks = [("self_attn.q_b_proj", heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim), cfg.q_lora_rank, tp,
               "--tp", "rows"),
              ("self_attn.kv_b_proj", heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank, tp, "--tp",
               "rows"),
              ("self_attn.o_proj", heads * cfg.v_head_dim, h, tp, "--tp", "input columns"),
              ("mlp.gate_proj/up_proj (dense layers)", cfg.intermediate_size, 2 * h, tp, "--tp", "rows"),
              ("mlp.down_proj (dense layers)", cfg.intermediate_size, h, tp, "--tp", "input columns"),
              ("mlp.shared_experts.down_proj", shared, h, tp, "--tp", "input columns"),
              ("mlp.experts.*", cfg.moe_intermediate_size, 0, etp, "--etp", "rows")]
    for name, width, other, size, flag, what in checks:
        if not shard_cuts(width, size) and not (other and held_whole(width, width * other, size)):
            return (f"--base-precision fp8: {flag} {size} splits {name}'s {width} {what} into "
                    f"{width // size if width % size == 0 else width / size:g} per rank, not a multiple of the "
                    f"FP8 release's {BLOCK}-wide scale blocks; use a {flag} that does")
    return None


def checkpoint_base_precision(load: Optional[str]) -> Optional[str]:
    """"fp8" / "bf16" for the base weights a torch_dist checkpoint (directory or --save root) holds; None when it
    holds no base matrix (not a checkpoint, an adapters-only checkpoint, or unreadable: loading it says more)."""
    if not load or not os.path.isdir(load):
        return None
    from megatron_glm5.checkpoint.format import (DCP_METADATA, CheckpointFormatError, iteration_dir,
                                                 load_dcp_metadata, read_latest)

    path = load
    try:
        if not os.path.isfile(os.path.join(load, DCP_METADATA)):
            pointer = read_latest(load)
            if pointer is None:
                return None
            path = iteration_dir(load, pointer)
        keys = load_dcp_metadata(path).state_dict_metadata
    except (CheckpointFormatError, OSError):
        return None
    probe = [k for k in keys if k.endswith("linear_q_up_proj.weight") and "optimizer" not in k]
    if not probe:
        return None
    return "fp8" if probe[0] + "_scale_inv" in keys else "bf16"


def _gpu_capability() -> Optional[Tuple[Tuple[int, int], str]]:
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(), torch.cuda.get_device_name()


def check(args: argparse.Namespace, cfg, cuda: bool, check_device: bool = True) -> Dict[str, Any]:
    """Refuse what --base-precision fp8 cannot do, in one line each; no derived values."""
    fp8 = args.base_precision == "fp8"
    saved = checkpoint_base_precision(getattr(args, "load", None))
    if saved == "fp8" and not fp8:
        raise FP8FlagError(f"--load {args.load} holds an FP8 base (e4m3 weights with weight_scale_inv): pass "
                           "--base-precision fp8, or convert the HF release to a bf16 checkpoint")
    if not fp8:
        return {}
    if saved == "bf16":
        raise FP8FlagError(f"--base-precision fp8: --load {args.load} holds a bf16 base (no FP8 weight_scale_inv "
                           "tensors); convert the FP8 release with tools/convert_hf_to_megatron.py --keep-fp8, or "
                           "leave --base-precision at bf16")
    trains_something = (getattr(args, "lora_rank", None) or getattr(args, "eval_only", False)
                        or getattr(args, "dsa_stage", None) == "dense-warmup")
    if not trains_something:
        raise FP8FlagError("--base-precision fp8 keeps the base frozen (FP8 weights get no gradient): add "
                           "--lora-rank N to train adapters on it, or use it with --eval-only")
    if cuda and check_device:
        capability, name = _gpu_capability()
        if tuple(capability) < MIN_CAPABILITY:
            raise FP8FlagError(f"--base-precision fp8 needs a GPU with FP8 support (compute capability 8.9 or newer: "
                               f"Ada, Hopper, Blackwell); {name} is {capability[0]}.{capability[1]}: use "
                               "--base-precision bf16 with a bf16 checkpoint")
    problem = _tp_split_problem(cfg, args.tensor_model_parallel_size, args.expert_tensor_parallel_size or 1)
    if problem:
        raise FP8FlagError(problem, flag="--tp")
    return {}
