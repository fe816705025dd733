"""``--cross-entropy-fusion``: the flag and the model-config fields it sets (stdlib-only at import: arguments.py
stays cheap to import).  The computation is model/linear_cross_entropy.py's."""
from __future__ import annotations

import argparse
from typing import Dict

from megatron_glm5.errors import FlagError

__all__ = ["CE_FUSIONS", "CrossEntropyFusionError", "add_flags", "config_overrides"]

CE_FUSIONS = ("none", "chunked")


class CrossEntropyFusionError(FlagError):
    """An unknown --cross-entropy-fusion value given through the Python API (argparse checks the flag's)."""

    FLAG = "--cross-entropy-fusion"


def add_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("output layer + cross entropy")
    g.add_argument("--cross-entropy-fusion", choices=CE_FUSIONS, default="none",
                   help="none: megatron-core's output layer, then the vocab-parallel cross entropy (under "
                        "--fusions auto on a GPU our compiled one, keeping the bf16 logits; else megatron-core's, "
                        "keeping an fp32 [tokens, vocab] softmax); chunked: output layer + cross entropy "
                        "over token chunks, no [tokens, vocab] tensor kept, one more output GEMM in the backward "
                        "(docs/design.md, 'Fused ops')")


def config_overrides(choice: str) -> Dict[str, object]:
    """The GLM5TransformerConfig fields of a --cross-entropy-fusion choice."""
    if choice not in CE_FUSIONS:
        raise CrossEntropyFusionError(f"--cross-entropy-fusion must be one of {', '.join(CE_FUSIONS)}, got {choice!r}")
    return {"cross_entropy_fusion": choice}
