"""Patch of megatron-core's distributed optimizer: resuming its state with torch's Adam (no TE / Apex)."""
from __future__ import annotations

import torch

from megatron_glm5.mcore_patches.record import Patch, Phase


def _distributed_optimizer_resume_without_te() -> bool:
    """megatron/core/optimizer/distrib_optimizer.py, DistributedOptimizer.load_state_dict (torch Adam: no TE/Apex).

    Two bugs when resuming with --use-distributed-optimizer:
    1. load_state_dict sets each parameter's ``step`` from the checkpoint, then copies every *tensor* of the
       state from the loaded parameter state, which carries no ``step`` -> ``KeyError: 'step'``. Fixed by handing
       the current ``step`` through (a copy onto itself).
    2. It gives every parameter the *same* ``step`` tensor object; torch's Adam increments ``step`` in place per
       parameter, so after one step the shared counter has advanced once per parameter and the bias correction
       is wrong from then on (the resumed run drifts from the uninterrupted one at its second step). Fixed by
       giving each parameter its own copy after loading.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(original, "_glm5_fixed", False):
        return False

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if "step" not in tensors:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            state = self.optimizer.state.get(main_param, {})
            if isinstance(state.get("step"), torch.Tensor):
                tensors = dict(tensors, step=state["step"])  # copy onto itself: unchanged
        return original(self, model_param, tensors)

    original_load = DistributedOptimizer.load_state_dict

    def load_state_dict(self, state_dict):
        result = original_load(self, state_dict)
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].detach().clone()
        return result

    _set_main_param_and_optimizer_states._glm5_fixed = True
    DistributedOptimizer._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states
    DistributedOptimizer.load_state_dict = load_state_dict
    return True


PATCHES = (
    Patch(
        name="distributed_optimizer_resume_without_te",
        site="megatron/core/optimizer/distrib_optimizer.py DistributedOptimizer.load_state_dict",
        why="resuming the distributed optimizer with torch's Adam raises KeyError 'step', then shares one step "
            "counter between all parameters",
        test="tests/test_training_cpu.py::test_resume_is_bitwise[pretrain]",
        phase=Phase.TRAINING, apply=_distributed_optimizer_resume_without_te),
)
