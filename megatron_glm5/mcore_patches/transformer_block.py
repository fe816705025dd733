"""Patch of the block megatron-core's GPTModel builds: re-classed to GLM-5's (model/block.py)."""
from __future__ import annotations

from megatron_glm5.mcore_patches.record import Patch, Phase


def _glm5_transformer_block(model) -> bool:
    """megatron/core/models/gpt/gpt_model.py, GPTModel.__init__ instantiates megatron-core's TransformerBlock
    itself (no parameter picks the class). GLM-5's subclass only overrides ``forward`` (full recomputation that
    carries the AttentionInputs object, IndexShare top-k across pipeline stages) and adds no state, so the built
    ``model.decoder`` is re-classed in place."""
    from megatron_glm5.model.block import GLM5TransformerBlock

    model.decoder.__class__ = GLM5TransformerBlock
    return True


PATCHES = (
    Patch(
        name="glm5_transformer_block",
        site="megatron/core/models/gpt/gpt_model.py GPTModel.__init__ (self.decoder)",
        why="megatron-core's block checkpoints only tensors in full recomputation, so the AttentionInputs "
            "object cannot pass through it",
        test="tests/test_recompute.py::test_full_recompute_matches",
        phase=Phase.ON_USE, applied_by="model/model.py GLM5Model.__init__, for every model",
        apply=_glm5_transformer_block),
)
