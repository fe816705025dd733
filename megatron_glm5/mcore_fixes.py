"""Fixes for megatron-core 0.19.2 bugs that hit GLM-5 training on any device (CPU-only shims live in platform.py).

Each fix is a small, named function with the megatron-core site and the failure it prevents; ``apply()`` is
idempotent and is called by the training loop.
"""
from __future__ import annotations

APPLIED: list[str] = []


def _distributed_optimizer_resume_without_te() -> None:
    """optimizer/distrib_optimizer.py, DistributedOptimizer.load_state_dict (torch Adam, i.e. without TE/Apex).

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
        return

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if "step" not in tensors:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            state = self.optimizer.state.get(main_param, {})
            if torch_is_tensor(state.get("step")):
                tensors = dict(tensors, step=state["step"])  # copy onto itself: unchanged
        return original(self, model_param, tensors)

    original_load = DistributedOptimizer.load_state_dict

    def load_state_dict(self, state_dict):
        result = original_load(self, state_dict)
        for state in self.optimizer.state.values():
            if torch_is_tensor(state.get("step")):
                state["step"] = state["step"].detach().clone()
        return result

    _set_main_param_and_optimizer_states._glm5_fixed = True
    DistributedOptimizer._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states
    DistributedOptimizer.load_state_dict = load_state_dict
    APPLIED.append("distributed_optimizer_resume_without_te")


def torch_is_tensor(x) -> bool:
    import torch
    return isinstance(x, torch.Tensor)


def apply() -> list[str]:
    _distributed_optimizer_resume_without_te()
    return APPLIED
