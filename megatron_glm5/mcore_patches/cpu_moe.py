"""CPU-only patch: the alltoall dispatcher's split sizes become numpy arrays on CPU too."""
from __future__ import annotations

import torch

from megatron_glm5.mcore_patches.record import Patch, Phase


def _moe_split_sizes_numpy() -> bool:
    """Let ``moe_utils.maybe_move_tensor_to_cpu(..., as_numpy=True)`` convert CPU tensors too.

    ``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize``
    (megatron/core/transformer/moe/token_dispatcher.py) turns ``input_splits``,
    ``output_splits`` and ``output_splits_tp`` into numpy arrays through this helper
    (megatron/core/transformer/moe/moe_utils.py), which only converts CUDA tensors.  On CPU
    they stay torch tensors and, with EP > 1 (or TP > 1 with the alltoall dispatcher),
    ``torch.distributed.all_to_all_single`` in ``tensor_parallel/mappings.py:_AllToAll``
    rejects them ("all_to_all_single(): incompatible function arguments").  Patched in
    ``moe_utils`` and in ``token_dispatcher`` (which imports it by name).
    """
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    upstream = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.detach().numpy().copy()  # a private copy, as the D2H copy gives
        return upstream(tensor, as_numpy=as_numpy, record_stream=record_stream)

    maybe_move_tensor_to_cpu.__doc__ = upstream.__doc__
    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    return True


PATCHES = (
    Patch(
        name='moe_split_sizes_numpy',
        site='megatron/core/transformer/moe/moe_utils.py maybe_move_tensor_to_cpu',
        why='with EP > 1 all_to_all_single rejects the split sizes left as CPU tensors',
        test='tests/test_platform.py::test_shim_is_needed[moe_split_sizes_numpy]',
        phase=Phase.CPU, apply=_moe_split_sizes_numpy),
)
