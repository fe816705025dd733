"""Initial weights that depend on the seed only, not on the parallel layout.

megatron-core initialises a parameter from whatever random state its rank reaches while building its own layers:
a pipeline stage that starts at layer 2 draws layer 2's weights first, a tensor-parallel rank on the GPU draws
from its own seed, an expert-parallel rank builds only its experts. So the same ``--seed`` gave another model at
PP2 than in one process. :func:`initialize_by_global_identity` redraws every randomly initialised tensor from its
*global* identity instead: the checkpoint key megatron-core gives it (layer numbers and expert indices already
global) and the element's global position. The values are generated in fixed blocks of global rows, each from a
generator seeded by ``(seed, key, block)``, with the model's own init function for that tensor (megatron-core's
``init_method``, or ``output_layer_init_method`` for the output projections), and each rank keeps the part of every
block that is its shard. Tensors megatron-core sets to a constant (norm weights, biases, the router's expert bias)
are left as they are: constants do not depend on the layout.

Equal at every layout on one device type (CPU runs equal CPU runs; GPU runs equal GPU runs: torch's CPU and CUDA
generators differ). A rank draws whole rows of its blocks, so a tensor-parallel shard of the columns costs TP times
its own share of random numbers; blocks are at most ``BLOCK_ELEMENTS`` so no tensor is ever materialised whole.
"""
from __future__ import annotations

import hashlib
import math
from typing import Callable, Iterable, Tuple

import torch

from megatron_glm5.fp8 import init as fp8_init

BLOCK_ELEMENTS = 1 << 24
# tensors megatron-core initialises with output_layer_init_method (the projections back into the residual stream)
_OUTPUT_LAYER_SUFFIXES = ("linear_proj.weight", "linear_fc2.weight", "experts.weight2")


def _block_seed(seed: int, key: str, block: int) -> int:
    digest = hashlib.sha256(f"{seed}:{key}:{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _sharded_tensors(sharded_state_dict) -> Iterable:
    """Every ShardedTensor of a model's sharded state dict, factories (fused gate|up) built into their parts."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    for value in nested_values(sharded_state_dict):
        if isinstance(value, ShardedTensorFactory):
            yield from _sharded_tensors(value.build())
        elif isinstance(value, ShardedTensor):
            yield value


def _is_constant(t: torch.Tensor) -> bool:
    flat = t.detach().reshape(-1)
    return flat.numel() == 0 or bool((flat == flat[0]).all())


def init_function(config, key: str) -> Callable[[torch.Tensor], None]:
    """The model's init function for the tensor under ``key``."""
    if key.endswith(_OUTPUT_LAYER_SUFFIXES):
        return config.output_layer_init_method
    return config.init_method


def _local_window(st) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """(global offset, local shape) of a ShardedTensor's data, over the global shape's dims."""
    skip = st.prepend_axis_num
    offset = tuple(st.global_offset[skip:])
    shape = tuple(st.data.shape[skip:]) if st.data.dim() == len(st.global_shape) else tuple(st.data.shape)
    return offset, shape


@torch.no_grad()
def fill_shard(data: torch.Tensor, key: str, global_shape: Tuple[int, ...], offset: Tuple[int, ...],
               init_fn: Callable[[torch.Tensor], None], seed: int) -> None:
    """Write into ``data`` (this rank's window at ``offset`` of the global tensor ``key``) the values the global
    tensor has for ``seed``: blocks of whole global rows, each drawn by ``init_fn`` from its own seeded state."""
    row_elements = math.prod(global_shape[1:]) if len(global_shape) > 1 else 1
    rows_per_block = max(1, BLOCK_ELEMENTS // max(1, row_elements))
    first, last = offset[0], offset[0] + data.shape[0]
    devices = [data.device] if data.device.type == "cuda" else []
    for block in range(first // rows_per_block, (last - 1) // rows_per_block + 1):
        b0 = block * rows_per_block
        b1 = min(b0 + rows_per_block, global_shape[0])
        values = torch.empty((b1 - b0, *global_shape[1:]), dtype=torch.float32, device=data.device)
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(_block_seed(seed, key, block))
            init_fn(values)
        lo, hi = max(first, b0), min(last, b1)
        piece = values[lo - b0:hi - b0]
        for dim in range(1, len(global_shape)):
            piece = piece.narrow(dim, offset[dim], data.shape[dim])
        data[lo - first:hi - first].copy_(piece.to(data.dtype))


def initialize_by_global_identity(model, seed: int) -> int:
    """Redraw every randomly initialised tensor of ``model`` (one model chunk) from its global identity. Returns
    the number of tensors redrawn."""
    config = model.config
    redrawn = 0
    tensors = list(_sharded_tensors(model.sharded_state_dict()))
    fp8_scales = fp8_init.scales_of(tensors)  # the frozen FP8 base (--base-precision fp8): weight -> its scales
    for st in tensors:
        if st.flattened_range is not None or not torch.is_floating_point(st.data) or fp8_init.is_scale_key(st.key):
            continue
        if not fp8_init.is_fp8(st.data) and _is_constant(st.data):
            continue
        offset, shape = _local_window(st)
        data = st.data.view(shape) if tuple(st.data.shape) != shape else st.data
        global_shape, init_fn = tuple(st.global_shape[st.prepend_axis_num:]), init_function(config, st.key)
        if fp8_init.is_fp8(data):  # drawn as the bf16 model's tensor, then quantised
            scale = fp8_scales[id(st)]
            fp8_init.redraw(data, scale.data.view(_local_window(scale)[1]), offset,
                            lambda values, off, key=st.key: fill_shard(values, key, global_shape, off, init_fn, seed))
        else:
            fill_shard(data, st.key, global_shape, offset, init_fn, seed)
        redrawn += 1
    return redrawn
