"""Token counts per expert left on the GPU when one rank holds every expert's tokens (no host-GPU synchronisation).

megatron-core's alltoall dispatcher (0.19.2, token_dispatcher.py ``_maybe_dtoh_and_synchronize``) copies
tokens_per_expert (and the split sizes) to the host and waits for that copy (``d2h_event.synchronize()``) before
the experts run; with several local experts it also splits and re-concatenates the tokens by chunk
(``sort_chunks_by_idxs``, host split sizes). With expert- and tensor-parallel size 1, dropless routing and no
router padding, nothing needs the host values: there are no all-to-all splits, the expert output size is
tokens x top-k (host-known), the chunk order of one rank is the identity, and our experts take the counts as a
device tensor (``moe.expert_offsets``: grouped_mm offsets). :func:`apply` then gives the layer's dispatcher a
subclass that keeps the counts on the GPU and skips the identity reordering: the same tensors, no host wait.
"""
from __future__ import annotations

import functools

from megatron_glm5.mcore_patches.record import Patch, Phase


def single_rank_dropless(dispatcher) -> bool:
    """Whether this alltoall dispatcher's host copies are unused: one EP and TP rank, dropless, no router padding."""
    cfg = dispatcher.config
    return (dispatcher.ep_size == 1 and dispatcher.tp_size == 1 and not dispatcher.drop_and_pad
            and cfg.moe_expert_capacity_factor is None and not cfg.moe_router_padding_for_quantization)


@functools.lru_cache(maxsize=None)
def device_counts_dispatcher(base: type) -> type:
    """The subclass of an alltoall dispatcher class (megatron-core's or our fused-permute one) for
    :func:`single_rank_dropless` layers."""

    def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        return tokens_per_expert  # stays on the GPU; nothing is waited for

    def dispatch_postprocess(self, global_input_tokens, global_probs):
        # megatron's: TP all-gather (size 1: none), chunk sort (one rank: the identity order), host counts
        tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None
        return global_input_tokens, tokens_per_expert, global_probs

    def combine_preprocess(self, hidden_states):
        return hidden_states  # the chunk restore of one rank is the identity; no TP reduce-scatter at size 1

    return type(f"{base.__name__}DeviceCounts", (base,), {
        "__module__": __name__, "__doc__": __doc__,
        "_maybe_dtoh_and_synchronize": _maybe_dtoh_and_synchronize,
        "dispatch_postprocess": dispatch_postprocess, "combine_preprocess": combine_preprocess})


def _moe_device_counts(layer) -> bool:
    """megatron/core/transformer/moe/token_dispatcher.py, MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize /
    dispatch_postprocess / combine_preprocess: an MoE layer's alltoall dispatcher gets the device-count subclass
    where :func:`single_rank_dropless` (else nothing changes)."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    dispatcher = layer.token_dispatcher
    if not isinstance(dispatcher, MoEAlltoAllTokenDispatcher) or not single_rank_dropless(dispatcher):
        return False
    dispatcher.__class__ = device_counts_dispatcher(type(dispatcher))
    return True


PATCHES = (
    Patch(
        name="moe_device_counts",
        site="megatron/core/transformer/moe/token_dispatcher.py MoEAlltoAllTokenDispatcher "
             "_maybe_dtoh_and_synchronize / dispatch_postprocess / combine_preprocess",
        why="megatron-core's alltoall dispatcher always copies the token counts to the host and waits for them, "
            "also on one rank where nothing reads them; no option keeps them on the GPU",
        test="tests/test_host_sync_free.py::test_moe_device_counts_same_loss_and_gradients",
        phase=Phase.ON_USE, applied_by="model/moe.py GLM5MoELayer.__init__, one EP and TP rank, dropless",
        apply=_moe_device_counts),
)
