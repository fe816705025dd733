"""The ``--optimizer muon`` flags and their one-line errors (stdlib only: arguments.py imports it).

The optimizer is training/muon.py, its megatron-core wiring training/muon_setup.py; docs/muon.md.
"""
from __future__ import annotations

import argparse
from typing import Optional

from megatron_glm5.errors import FlagError, UserError

SCALE_MODES = ("spectral", "shape_scaling", "unit_rms_norm")
MUON_STATE_BYTES = 4  # one fp32 momentum buffer per element (Adam: two fp32 moments)


def takes_muon(name: str, kind: str) -> bool:
    """The planner's form of the rule (training/muon_setup.py ``_takes_muon`` reads the parameters themselves):
    weights of matrices and grouped experts, not the embedding / output head or a norm; from the inventory's
    tensor names (planning/inventory.py)."""
    return name.endswith((".weight", "experts.weight1", "experts.weight2")) and kind != "embedding" \
        and "norm." not in name


class MuonFlagError(FlagError):
    """A Muon flag out of range or in a combination Muon cannot run; ``flag`` names it."""


def add_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Muon (read with --optimizer muon; docs/muon.md)")
    g.add_argument("--muon-momentum", type=float, default=0.95, metavar="X", help="momentum (EMA) coefficient")
    g.add_argument("--muon-nesterov", action=argparse.BooleanOptionalAction, default=True,
                   help="Nesterov momentum")
    g.add_argument("--muon-ns-steps", "--muon-num-ns-steps", dest="muon_ns_steps", type=int, default=5,
                   metavar="N", help="Newton-Schulz iterations")
    g.add_argument("--muon-scale-mode", choices=SCALE_MODES, default="spectral",
                   help="update scale per [m, n] matrix: spectral sqrt(max(m, n)), shape_scaling "
                        "sqrt(max(1, m/n)), unit_rms_norm sqrt(m/n)")
    g.add_argument("--muon-matched-adamw-rms", type=float, default=0.0, metavar="X",
                   help="> 0: scale every update to RMS X, as AdamW's (Moonlight: 0.2), so AdamW's --lr and "
                        "--weight-decay carry over; replaces --muon-scale-mode")
    g.add_argument("--muon-extra-scale-factor", type=float, default=1.0, metavar="X",
                   help="a further factor on every Muon update")
    g.add_argument("--muon-split-heads", action=argparse.BooleanOptionalAction, default=True,
                   help="orthogonalise the MLA q/kv up-projections, the output projection and the indexer's q "
                        "projection per head (GLM-5's Muon Split)")


def check(args) -> None:
    """Raise MuonFlagError for a Muon flag Muon cannot run with (read only with --optimizer muon)."""
    if args.optimizer != "muon":
        return
    if not 0.0 <= args.muon_momentum < 1.0:
        raise MuonFlagError(f"--muon-momentum {args.muon_momentum:g} must be in [0, 1)", flag="--muon-momentum")
    if args.muon_ns_steps < 1:
        raise MuonFlagError(f"--muon-ns-steps {args.muon_ns_steps} must be at least 1", flag="--muon-ns-steps")
    if args.muon_matched_adamw_rms < 0:
        raise MuonFlagError("--muon-matched-adamw-rms must be >= 0 (0: use --muon-scale-mode)",
                            flag="--muon-matched-adamw-rms")
    if args.muon_matched_adamw_rms > 0 and args.muon_scale_mode != "spectral":
        raise MuonFlagError("--muon-matched-adamw-rms sets the update scale itself: drop --muon-scale-mode "
                            f"{args.muon_scale_mode}", flag="--muon-scale-mode")
    if getattr(args, "optimizer_cpu_offload", False):
        raise MuonFlagError("--optimizer-cpu-offload is megatron-core's HybridDeviceOptimizer, an Adam: not with "
                            "--optimizer muon; drop it", flag="--optimizer-cpu-offload")
    if args.overlap_param_gather:
        raise MuonFlagError("--overlap-param-gather is not supported with --optimizer muon (megatron-core's "
                            "layer-wise optimizer gathers the parameters after the step): drop it",
                            flag="--overlap-param-gather")


OPTIMIZER_FORM_KEY = "optimizer_form"  # in a checkpoint's common state (training/checkpointing.py)


class OptimizerStateMismatch(UserError, ValueError):
    """--load: the checkpoint's optimizer state is of another optimizer (or Muon's other form)."""


def optimizer_form(args) -> dict:
    """What wrote a checkpoint's optimizer state: Adam or Muon, and Muon's form (plain or layer-wise)."""
    name = getattr(args, "optimizer", "adam")
    return {"optimizer": name, "layer_wise": name == "muon" and bool(getattr(args, "use_distributed_optimizer", False))}


def _describe(form: dict) -> str:
    if form["optimizer"] != "muon":
        return f"--optimizer {form['optimizer']}"
    return "--optimizer muon " + ("with" if form["layer_wise"] else "without") + " --use-distributed-optimizer"


def check_resume(saved: Optional[dict], args, path: str) -> None:
    """Refuse to load an optimizer state another optimizer wrote (a checkpoint without the record: Adam's). Adam's
    plain and distributed forms convert (training/optimizer_state.py); Muon's two forms chain their optimizers
    differently and do not."""
    saved = dict(saved) if saved else {"optimizer": "adam", "layer_wise": False}
    mine = optimizer_form(args)
    if saved["optimizer"] == mine["optimizer"] and (mine["optimizer"] != "muon"
                                                    or saved["layer_wise"] == mine["layer_wise"]):
        return
    raise OptimizerStateMismatch(f"--load {path}: its optimizer state was written by {_describe(saved)}, this run "
                                 f"uses {_describe(mine)}: resume with the same flags, or pass --no-load-optim to "
                                 "start the optimizer afresh (weights, schedule and data position still resume)")


def ddp_shards_grads(args) -> bool:
    """DistributedDataParallelConfig.use_distributed_optimizer: off for Muon, whose distributed form
    (megatron-core's layer-wise optimizer) needs whole gradients and shards whole parameters over the ranks."""
    return bool(args.use_distributed_optimizer) and args.optimizer != "muon"
