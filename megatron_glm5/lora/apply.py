"""Put LoRA adapters on a built model chunk and freeze everything else (before DDP and the optimizer see it).

Trainable afterwards: the adapters, and with --train-indexer the DSA lightning indexers (trained by their KL
loss). megatron-core's DDP builds gradient buffers only for parameters that require grad, and its optimizer
collects only those: the frozen base has no gradient, no fp32 main copy and no Adam state. A is drawn from its
checkpoint key and global position (model/init.py's ``fill_shard``), B is zero: the same --seed gives the same
adapters at every parallel layout, and the model starts as the base.
"""
from __future__ import annotations

import logging
import math

from megatron_glm5.lora import targets as lora_targets
from megatron_glm5.lora.adapters import ColumnLoRA, RowLoRA, lora_class
from megatron_glm5.lora.checkpoint import AdapterScope
from megatron_glm5.lora.config import LoRAConfig
from megatron_glm5.lora.grouped import grouped_lora_class

log = logging.getLogger("megatron_glm5.lora")
INDEXER_PART = "core_attention.indexer."
_A_NAMES = ("lora_a", "lora_a1", "lora_a2")


def is_adapter_name(name: str) -> bool:
    return name.rsplit(".", 1)[-1].startswith("lora_")


def _attach(module, name: str, kinds: set, cfg: LoRAConfig) -> None:
    if kinds & {"experts_fc1", "experts_fc2"}:
        if not hasattr(module, "linear_fc1"):
            raise TypeError(f"{name}: {type(module).__name__} has no grouped linear_fc1/linear_fc2 to adapt")
        module.__class__ = grouped_lora_class(type(module))
        module.attach(cfg.rank, cfg.alpha, cfg.dropout, fc1="experts_fc1" in kinds, fc2="experts_fc2" in kinds)
        return
    (kind,) = kinds
    mixin, needs = ((ColumnLoRA, "output_size_per_partition") if kind == "column"
                    else (RowLoRA, "input_size_per_partition"))
    if not hasattr(module, needs):
        raise TypeError(f"{name}: {type(module).__name__} is not a {kind}-parallel linear")
    module.__class__ = lora_class(type(module), mixin)
    module.attach(cfg.rank, cfg.alpha, cfg.dropout)


def _draw_a(model, seed: int) -> None:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_glm5.model.init import fill_shard

    for st in nested_values(model.sharded_state_dict()):
        if not isinstance(st, ShardedTensor) or st.key.rsplit(".", 1)[-1] not in _A_NAMES:
            continue
        skip = st.prepend_axis_num
        shape = tuple(st.global_shape[skip:])
        bound = 1.0 / math.sqrt(shape[-1])  # kaiming-uniform(a=sqrt(5)) of A's input features, as PEFT draws it
        fill_shard(st.data, st.key, shape, tuple(st.global_offset[skip:]), lambda t: t.uniform_(-bound, bound), seed)


def apply_lora(model, cfg: LoRAConfig, seed: int) -> int:
    """Adapt ``model`` (one model chunk) in place; returns the number of adapted modules."""
    adapted = 0
    for name, module in list(model.named_modules()):
        names = lora_targets.match(name, cfg.targets)
        if names:
            _attach(module, name, {lora_targets.TARGETS[t][1] for t in names}, cfg)
            adapted += 1
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_name(name) or (cfg.train_indexer and INDEXER_PART in name))
    _draw_a(model, seed)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    model.checkpoint_scope = AdapterScope(cfg, trainable, mtp=bool(getattr(model.config, "mtp_num_layers", None)))
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info("LoRA rank %d alpha %g on %d modules (%s): %d trainable parameters in this chunk", cfg.rank, cfg.alpha,
             adapted, ",".join(cfg.targets), n_train)
    return adapted
