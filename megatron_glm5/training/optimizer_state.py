"""A checkpoint's optimizer state loaded into the other kind of megatron-core optimizer (--use-distributed-optimizer
switched on or off at a resume).

megatron-core's plain optimizers (FP32Optimizer; Float16OptimizerWithFloat16Params in bf16) and its
DistributedOptimizer (``fully_reshardable``, the format checkpointing.py saves) store Adam's moments alike: per
parameter in model space, ``optimizer.state.exp_avg.<param>`` / ``optimizer.state.exp_avg_sq.<param>`` (behind a
``chained_<i>.`` prefix per chained optimizer). They differ in

- the fp32 main parameters: ``optimizer.state.param.<param>`` (distributed), ``optimizer.state.fp32_param.<param>``
  (plain bf16), none (plain fp32: the model's weights are the main parameters);
- the rest: torch's ``{state: {common_step}, param_groups (with params)}`` (plain; under ``optimizer`` in bf16) or
  ``{optimizer: {param_groups (with step)}, param_state, param_state_sharding_type}`` (distributed).

:func:`retarget` points the current optimizer's load request at the saved tensors (main parameters from the other
key, or from the loaded model weights); :func:`convert` rebuilds the loaded state in the current optimizer's shape.
Adam's moments, step and parameter-group settings carry over exactly, so training continues as it would have.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

DISTRIBUTED, PLAIN = "distributed", "plain"
_PARAM, _FP32_PARAM = ".optimizer.state.param.", ".optimizer.state.fp32_param."


def TENSOR_TYPES() -> tuple:  # noqa: N802 - a constant that needs megatron-core imported
    """The request entries that name a stored tensor: ShardedTensors and their factories (e.g. the SwiGLU fc1
    weight, stored as one tensor, requested as its two halves)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    return ShardedTensor, ShardedTensorFactory


def _inner(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def kind(optimizer) -> str:
    """DISTRIBUTED when the optimizer (or any it chains) is megatron-core's DistributedOptimizer, else PLAIN."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return DISTRIBUTED if any(isinstance(o, DistributedOptimizer) for o in _inner(optimizer)) else PLAIN


def _entries(state) -> List[dict]:
    """The per-optimizer entries of a (chained) optimizer state dict: {0: .., 1: ..} or one optimizer's dict."""
    if isinstance(state, dict) and state and all(isinstance(k, int) for k in state):
        return [state[k] for k in sorted(state)]
    return [state]


def saved_kind(common_optimizer) -> Optional[str]:
    """The kind of optimizer that wrote a checkpoint's optimizer state (its common, non-tensor part)."""
    if not isinstance(common_optimizer, dict):
        return None
    dist = [isinstance(e, dict) and "param_state_sharding_type" in e for e in _entries(common_optimizer)]
    return DISTRIBUTED if any(dist) else PLAIN


def _leaves(obj, path=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _leaves(v, path + (i,))
    else:
        yield path, obj


def retarget(request: dict, saved_keys, model_keys: set) -> List[Tuple[tuple, str]]:
    """Point the ShardedTensors of an optimizer load request that the checkpoint lacks at what it has: a
    distributed optimizer's main parameter at the plain bf16 one's and back. A main parameter the checkpoint has
    no copy of (it was written by a plain fp32 optimizer) is taken out of the request: returned as (path in the
    request, model tensor key), to be filled from the loaded model weights (:func:`fill_from_model`)."""
    from_model = []
    for path, leaf in list(_leaves(request)):
        if not isinstance(leaf, TENSOR_TYPES()) or leaf.key in saved_keys:
            continue
        for mine, theirs in ((_PARAM, _FP32_PARAM), (_FP32_PARAM, _PARAM)):
            if mine in leaf.key and leaf.key.replace(mine, theirs) in saved_keys:
                leaf.key = leaf.key.replace(mine, theirs)
                break
        else:
            model_key = leaf.key.split(_PARAM, 1)[1] if _PARAM in leaf.key else None
            if model_key in model_keys:
                from_model.append((path, model_key))
    for path, _ in from_model:  # (removed after the walk: the paths of later leaves stay valid)
        parent = request
        for k in path[:-1]:
            parent = parent[k]
        del parent[path[-1]]
    return from_model


def fill_from_model(loaded: dict, from_model: List[Tuple[tuple, str]], model_tensors: Dict[str, torch.Tensor]):
    """Put the loaded model weights where :func:`retarget` took main parameters out of the request."""
    for path, key in from_model:
        parent = loaded
        for k in path[:-1]:
            parent = parent.setdefault(k, {})
        parent[path[-1]] = model_tensors[key].detach().clone().float()


def _step_value(step) -> float:
    return float(step.item() if torch.is_tensor(step) else step)


def _identifier(group: dict) -> tuple:
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    return tuple(group.get(k, group.get(f"pre_{k}")) for k in param_group_identifier_keys)


def _to_distributed(entry: dict) -> dict:
    plain = entry["optimizer"] if isinstance(entry.get("optimizer"), dict) and "state" in entry["optimizer"] else entry
    step = _step_value(plain.get("state", {}).get("common_step", 0))
    groups = [dict({k: v for k, v in g.items() if k != "params"}, step=step) for g in plain["param_groups"]]
    out = {"optimizer": {"param_groups": groups}, "param_state": entry["param_state"],
           "param_state_sharding_type": "fully_reshardable"}
    if "grad_scaler" in entry:
        out["grad_scaler"] = entry["grad_scaler"]
    return out


def _to_plain(entry: dict, optimizer) -> dict:
    saved_groups = entry["optimizer"]["param_groups"]
    steps = {_step_value(g["step"]) for g in saved_groups if "step" in g}
    step = steps.pop() if len(steps) == 1 else 0.0
    by_id = {_identifier(g): g for g in saved_groups}
    groups = []
    for current in optimizer.optimizer.state_dict()["param_groups"]:
        saved = by_id.get(_identifier(current))
        if saved is None:
            raise KeyError(f"no saved parameter group matches {_identifier(current)}")
        groups.append(dict({k: v for k, v in saved.items() if k != "step"}, params=current["params"]))
    mixed = hasattr(optimizer, "fp32_from_float16_groups")  # bf16: fp32 main copies beside torch's state
    tensors = entry["optimizer"].get("state", {}) if mixed else entry.get("state", {})
    inner = {"state": dict({k: v for k, v in tensors.items() if isinstance(k, int)},
                           common_step=torch.tensor(step)), "param_groups": groups}
    if not mixed:
        return inner
    out = {"optimizer": inner, "fp32_from_fp16_params": entry["fp32_from_fp16_params"]}
    if "grad_scaler" in entry:
        out["grad_scaler"] = entry["grad_scaler"]
    return out


def convert(loaded_optimizer, optimizer, saved: str) -> Any:
    """The loaded optimizer state (a checkpoint of kind ``saved``, tensors loaded through the current optimizer's
    retargeted request) in the form the current optimizer's load_state_dict takes."""
    entries = _entries(loaded_optimizer)
    inner = _inner(optimizer)
    if len(entries) != len(inner):
        raise KeyError(f"the checkpoint has {len(entries)} chained optimizer(s), this run {len(inner)}")
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    out = []
    for entry, opt in zip(entries, inner):
        if isinstance(opt, DistributedOptimizer):
            out.append(_to_distributed(entry) if saved == PLAIN else entry)
        else:
            out.append(_to_plain(entry, opt) if saved == DISTRIBUTED else entry)
    return out[0] if not hasattr(optimizer, "chained_optimizers") or len(inner) == 1 else dict(enumerate(out))
