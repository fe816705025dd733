"""``--fusions {auto,none}``: the flag and the model-config fields it sets (stdlib-only at import: arguments.py stays
cheap to import). The regions themselves: model/fusions.py.

auto: on when CUDA is available -- our SwiGLU kernel (model/swiglu.py; megatron-core's MLP calls it through its
activation-module slot, which it reads when ``use_te_activation_func`` is set -- the field's name notwithstanding,
no Transformer Engine is involved) and our compiled elementwise regions (``elementwise_fusion``: model/fusions.py's
regions, the cross entropy of model/fused_cross_entropy.py among them); the first training step then compiles them
(torch.compile, tens of seconds). none: every op eager, as on a CPU. The CPU path is eager either way.
"""
from __future__ import annotations

import argparse
from typing import Dict, Optional

from megatron_glm5.errors import FlagError

__all__ = ["FUSIONS", "FusionsError", "add_flags", "config_overrides"]

FUSIONS = ("auto", "none")


class FusionsError(FlagError):
    """An unknown --fusions value given through the Python API (argparse checks the flag's)."""

    FLAG = "--fusions"


def add_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("fused elementwise ops")
    g.add_argument("--fusions", choices=FUSIONS, default="auto",
                   help="auto: on a CUDA GPU, RMSNorm, RoPE (+ the MLA / indexer concatenations), the MoE router's "
                        "top-k and the LM cross entropy run as torch.compile'd regions (compiled in the first "
                        "step), SwiGLU as our Triton kernel; none: all eager (docs/fusions.md)")


def config_overrides(choice: str, cuda: Optional[bool] = None) -> Dict[str, object]:
    """The GLM5TransformerConfig fields of a --fusions choice; ``cuda`` defaults to torch.cuda.is_available().
    Off (none, or auto without CUDA): no fields, the config's defaults are the unfused path."""
    if choice not in FUSIONS:
        raise FusionsError(f"--fusions must be one of {', '.join(FUSIONS)}, got {choice!r}")
    if cuda is None:
        import torch
        cuda = torch.cuda.is_available()
    if choice == "auto" and cuda:
        return {"use_te_activation_func": True, "elementwise_fusion": True}
    return {}
