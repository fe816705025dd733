"""Patch of megatron-core's alltoall / allgather token dispatchers: their permute / unpermute resolved to our Triton
kernels (ops/triton_moe_permute.py) for --moe-permute-fusion, in a subclass per dispatcher."""
from __future__ import annotations

import functools
import types

from megatron_glm5.mcore_patches.record import Patch, Phase


@functools.lru_cache(maxsize=None)
def _permuting_methods() -> dict:
    """megatron-core dispatcher -> its methods that call moe_utils' permute / unpermute (0.19.2)."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher

    return {
        MoEAlltoAllTokenDispatcher: ("dispatch_preprocess", "combine_postprocess"),
        MoEAllGatherTokenDispatcher: ("dispatch_postprocess", "combine_preprocess"),
    }


def permutes_with_moe_utils(dispatcher_class: type) -> bool:
    """Whether this megatron-core dispatcher class is one whose permute / unpermute the patch replaces."""
    return dispatcher_class in _permuting_methods()


def _with_fused_permute(method):
    """A copy of a megatron-core dispatcher method whose module-level ``permute`` / ``unpermute`` are ours.

    megatron-core calls them as module globals of token_dispatcher.py; rebinding the method's globals (not the
    module's) keeps every step of megatron's own method -- metadata, syncs, shared-expert overlap -- and changes
    only this layer's dispatcher, nothing for other users of megatron-core."""
    from megatron_glm5.ops import triton_moe_permute as fused

    if not {"permute", "unpermute"} & set(method.__code__.co_names):
        raise RuntimeError(f"megatron-core's {method.__qualname__} no longer calls permute/unpermute; "
                           "--moe-permute-fusion needs updating for this megatron-core version")
    scope = dict(method.__globals__, permute=fused.permute, unpermute=fused.unpermute)
    copy_ = types.FunctionType(method.__code__, scope, method.__name__, method.__defaults__, method.__closure__)
    copy_.__kwdefaults__, copy_.__doc__, copy_.__qualname__ = method.__kwdefaults__, method.__doc__, method.__qualname__
    return copy_


@functools.lru_cache(maxsize=None)
def fused_permute_dispatcher(base: type) -> type:
    """The subclass of a megatron-core dispatcher (alltoall or allgather) that permutes with our kernels."""
    methods = {name: _with_fused_permute(getattr(base, name)) for name in _permuting_methods()[base]}
    return type(f"FusedPermute{base.__name__}", (base,), {"__module__": __name__, **methods})


def _moe_fused_permute(layer, pg_collection) -> bool:
    """megatron/core/transformer/moe/token_dispatcher.py, MoEAlltoAllTokenDispatcher.dispatch_preprocess /
    combine_postprocess and MoEAllGatherTokenDispatcher.dispatch_postprocess / combine_preprocess call
    moe_utils' unfused ``permute`` / ``unpermute``: the MoE layer's dispatcher (one of those two, see
    :func:`permutes_with_moe_utils`) is replaced by :func:`fused_permute_dispatcher`'s, built the same way."""
    layer.token_dispatcher = fused_permute_dispatcher(type(layer.token_dispatcher))(
        layer.num_local_experts, layer.local_expert_indices, config=layer.config, pg_collection=pg_collection)
    if layer.shared_expert_overlap:
        layer.token_dispatcher.set_shared_experts(layer.shared_experts)
    return True


PATCHES = (
    Patch(
        name="moe_fused_permute",
        site="megatron/core/transformer/moe/token_dispatcher.py permute / unpermute (alltoall, allgather)",
        why="megatron-core's dispatchers take their permute functions from module globals, no option selects "
            "other kernels",
        test="tests/test_moe_permute.py::test_interp_tiny_moe_model_fused_equals_unfused",
        phase=Phase.ON_USE, applied_by="model/moe.py GLM5MoELayer.__init__, with --moe-permute-fusion",
        apply=_moe_fused_permute),
)
