"""Layout-independent initial weights for the frozen FP8 base (the FP8 side of model/init.py).

An FP8 weight of a model trained from scratch gets the values the bf16 model draws for the same ``--seed``
(model/init.py: blocks of global rows, seeded by the checkpoint key), quantised into 128x128 blocks: drawn in fp32
one weight at a time (one expert at a time for the stacked experts), never a whole layer's experts. A rank's shard
cuts on block boundaries (fp8/modules.py), so quantising the shard gives the global tensor's blocks.
"""
from __future__ import annotations

from typing import Callable, Dict, List

import torch

from megatron_glm5.fp8.blocks import FP8_DTYPE, SCALE_SUFFIX, quantize_blocks


def is_fp8(data: torch.Tensor) -> bool:
    return data.dtype == FP8_DTYPE


def is_scale_key(key: str) -> bool:
    return key.endswith(SCALE_SUFFIX)


def scales_of(sharded_tensors) -> Dict[int, object]:
    """id(FP8 weight's ShardedTensor) -> its scales' ShardedTensor (a fused gate|up weight's two halves pair with
    their scales' two halves in order)."""
    by_key: Dict[str, List] = {}
    for st in sharded_tensors:
        by_key.setdefault(st.key, []).append(st)
    out = {}
    for key, weights in by_key.items():
        if weights and is_fp8(weights[0].data) and key + SCALE_SUFFIX in by_key:
            out.update((id(w), s) for w, s in zip(weights, by_key[key + SCALE_SUFFIX]))
    return out


@torch.no_grad()
def redraw(q: torch.Tensor, scale_inv: torch.Tensor, offset, draw: Callable[[torch.Tensor, tuple], None]) -> None:
    """Fill this rank's FP8 window ``q`` (global-tensor dims, at ``offset``) and its ``scale_inv``:
    ``draw(values, offset)`` writes the fp32 values of the global tensor's window at ``offset`` into ``values``."""
    if q.dim() == 2:
        units = [(q, scale_inv, tuple(offset))]
    else:  # stacked experts: one expert at a time
        units = [(q[i], scale_inv[i], (offset[0] + i,) + tuple(offset[1:])) for i in range(q.shape[0])]
    for qi, si, off in units:
        values = torch.empty(((1,) if q.dim() > 2 else ()) + tuple(qi.shape), dtype=torch.float32, device=q.device)
        draw(values, off)
        new_q, new_s = quantize_blocks(values.reshape(qi.shape))
        qi.copy_(new_q)
        si.copy_(new_s)
        del values
