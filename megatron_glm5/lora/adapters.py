"""LoRA on megatron-core's parallel linears: y = base(x) + (alpha/r) * B(A(dropout(x))), the base untouched.

A linear of the built model becomes its LoRA form in place (apply.py swaps its class for ``lora_class(type)``, a
subclass of the base's own class), so its parameter names, its base forward and its checkpoint keys stay what
they were (a bf16 ColumnParallelLinear, or a frozen FP8 linear alike); ``lora_a`` / ``lora_b`` are added.

Tensor parallelism, as the base shards:
- column-parallel (output rows split): A [r, in] replicated, B [out/tp, r] sharded like the weight. The gradient
  of A sums the TP ranks' partial products: without sequence parallelism ``h = A x`` passes an identity whose
  backward all-reduces its gradient (so A's and the input's gradients are complete); with sequence parallelism
  each rank applies A to its sequence shard and all-gathers ``h`` ([s, b, r]: r numbers a token, not H);
- row-parallel (input columns split): A [r, in/tp] sharded like the weight, B [out, r] replicated; the partial
  ``h`` is all-reduced (or reduce-scattered over the sequence with sequence parallelism) like the base's output.
- ``local_linear`` / ``dense_weight`` serve GLM-5's absorbed MLA (model/mla.py), which applies q_down, kv_down,
  q_up to an input it gathered itself and uses kv_up's weight in place: there the input's gradient is summed over
  TP by the caller, so A's gradient is summed through an identity on A (``copy_to`` of a [r, in] tensor).
  kv_b's adapter enters the absorbed attention as W + (alpha/r) B A: dropout does not apply to it.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

LORA_PREFIX = "lora_"


def _device_of(module: torch.nn.Module) -> torch.device:
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return torch.device("cpu")


def new_adapter(module, shape, dtype) -> torch.nn.Parameter:
    """A zero parameter beside ``module``'s base weights (apply.py draws A afterwards, from its global identity)."""
    return torch.nn.Parameter(torch.zeros(*shape, dtype=dtype, device=_device_of(module)))


class _LoRALinear:
    """The LoRA part shared by the column- and row-parallel forms (a mixin placed before the base class)."""

    lora_tp_axis = {}  # which of lora_a / lora_b is sharded like the weight, and on which axis

    def init_lora(self, rank: int, alpha: float, dropout: float, in_features: int, out_features: int) -> None:
        dtype = self.config.params_dtype
        self.lora_a = new_adapter(self, (rank, in_features), dtype)
        self.lora_b = new_adapter(self, (out_features, rank), dtype)
        self.lora_scaling = alpha / rank
        self.lora_dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        for name in ("lora_a", "lora_b"):
            axis = self.lora_tp_axis.get(name)
            tensor_parallel.set_tensor_model_parallel_attributes(getattr(self, name), is_parallel=axis is not None,
                                                                 dim=axis if axis is not None else 0, stride=1)

    def _tp(self):
        return self.tp_group

    def _tp_size(self) -> int:
        return self.tp_group.size() if self.tp_group is not None else 1

    def _base_dense_weight(self) -> torch.Tensor:
        own = getattr(super(), "dense_weight", None)
        return own() if own is not None else self.weight

    def _base_local_linear(self, x):
        own = getattr(super(), "local_linear", None)
        return own(x) if own is not None else F.linear(x, self.weight)

    def lora_delta_weight(self) -> torch.Tensor:
        """(alpha/r) B A of this rank's shard, in the shape of the local weight (no autograd: merging)."""
        with torch.no_grad():
            return (self.lora_b.float() @ self.lora_a.float()) * self.lora_scaling

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        base = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        out = {k: v for k, v in base.items() if not k[len(prefix):].startswith(LORA_PREFIX)}
        dp_cp = metadata.get("dp_cp_group") if metadata else None
        out.update(make_sharded_tensors_for_checkpoint(
            {"lora_a": self.lora_a, "lora_b": self.lora_b}, prefix, dict(self.lora_tp_axis), sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=dp_cp))
        return out


class ColumnLoRA(_LoRALinear):
    lora_tp_axis = {"lora_b": 0}

    def attach(self, rank: int, alpha: float, dropout: float) -> None:
        self.init_lora(rank, alpha, dropout, self.input_size, self.output_size_per_partition)

    def forward(self, input_, *args, **kwargs):
        out, bias = super().forward(input_, *args, **kwargs)
        x = self.lora_dropout(input_)
        group = self.tp_group
        if getattr(self, "sequence_parallel", False) and self._tp_size() > 1:
            a = copy_to_tensor_model_parallel_region(self.lora_a, group=group)
            h = gather_from_sequence_parallel_region(F.linear(x, a), group=group)
        else:
            h = copy_to_tensor_model_parallel_region(F.linear(x, self.lora_a), group=group)
        delta = F.linear(h, self.lora_b) * self.lora_scaling
        if getattr(self, "gather_output", False) and self._tp_size() > 1:
            delta = gather_from_tensor_model_parallel_region(delta, group=group)
        return out + delta.to(out.dtype), bias

    def local_linear(self, x):
        a = copy_to_tensor_model_parallel_region(self.lora_a, group=self.tp_group)
        delta = F.linear(F.linear(self.lora_dropout(x), a), self.lora_b) * self.lora_scaling
        base = self._base_local_linear(x)
        return base + delta.to(base.dtype)

    def dense_weight(self):
        a = copy_to_tensor_model_parallel_region(self.lora_a, group=self.tp_group)
        w = self._base_dense_weight()
        return w + (self.lora_b @ a).to(w.dtype) * self.lora_scaling


class RowLoRA(_LoRALinear):
    lora_tp_axis = {"lora_a": 1}

    def attach(self, rank: int, alpha: float, dropout: float) -> None:
        if not getattr(self, "input_is_parallel", True):
            raise TypeError("LoRA on a RowParallelLinear needs input_is_parallel=True (as every GLM-5 one has)")
        self.init_lora(rank, alpha, dropout, self.input_size_per_partition, self.output_size)

    def forward(self, input_, *args, **kwargs):
        out, bias = super().forward(input_, *args, **kwargs)
        h = F.linear(self.lora_dropout(input_), self.lora_a)
        group, b = self.tp_group, self.lora_b
        if getattr(self, "sequence_parallel", False) and self._tp_size() > 1:
            h = reduce_scatter_to_sequence_parallel_region(h, group=group)
            b = copy_to_tensor_model_parallel_region(b, group=group)  # each rank saw its sequence shard
        else:
            h = reduce_from_tensor_model_parallel_region(h, group=group)
        delta = F.linear(h, b) * self.lora_scaling
        return out + delta.to(out.dtype), bias


@functools.lru_cache(maxsize=None)
def lora_class(base_cls: type, mixin: type) -> type:
    """The LoRA form of ``base_cls``: ``mixin``'s forward around the base class's own."""
    return type(f"LoRA{base_cls.__name__}", (mixin, base_cls), {"__module__": __name__})
