"""--moe-permute-fusion: whether the MoE dispatchers permute / unpermute with our Triton kernels
(ops/triton_moe_permute.py). Read by the alltoall / allgather path (model/moe.py) and the hierarchical
dispatcher (model/hybridep_dispatcher.py)."""
from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch

from megatron_glm5.errors import UserError


class MoEPermuteFusionUnavailable(UserError, ValueError):
    """--moe-permute-fusion asked for where its Triton kernels cannot run."""


def moe_permute_fusion_enabled(requested: Optional[bool]) -> bool:
    """--moe-permute-fusion: None (default) -> on when CUDA and triton are available; True needs them (or
    Triton's CPU interpreter, TRITON_INTERPRET=1, as in the tests)."""
    has_triton = importlib.util.find_spec("triton") is not None
    if requested is None:
        return has_triton and torch.cuda.is_available()
    if requested and not (has_triton and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")):
        raise MoEPermuteFusionUnavailable(
            "--moe-permute-fusion needs triton and a CUDA GPU" + ("" if has_triton else " (triton is not installed)")
            + "; use --no-moe-permute-fusion")
    return bool(requested)
