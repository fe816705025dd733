"""The frozen FP8 base's modules: megatron-core's parallel linears and GLM-5's grouped experts holding a
float8_e4m3fn ``weight`` and an fp32 ``weight_scale_inv`` (fp8/blocks.py's format, the release's tensors as they
are), both frozen parameters (``requires_grad`` False: no gradient, no optimizer state, no DDP buffer).

They are chosen where the layer spec is built (model/spec.py, ``--base-precision fp8``) in place of
ColumnParallelLinear / RowParallelLinear / GLM5GroupedExperts for the large matrices: attention q_a, q_b, kv_a,
kv_b, o; dense and shared-expert fc1/fc2; the routed experts. Everything else (norms, embedding, output head,
router, the indexer, MTP's eh_proj) stays as it is.

No bf16 copy of a weight is allocated at build: the parent's constructor runs with its weight on the meta device
(and no initialisation), then the FP8 tensors are allocated where the parent would have put its weight.

Tensor parallelism: a rank holds its shard of the weight with the scale blocks of that shard, so a shard must cut
on 128-row (column-parallel) or 128-column (row-parallel) boundaries. A small linear whose shard does not
(``kv_a_proj_with_mqa``'s 576 rows at TP 2/4/8, tiny test models; fp8/flags.py ``held_whole``) holds the whole
weight on every rank instead: column-parallel, it returns its own rows of the output; row-parallel, it multiplies
its input columns (zeros elsewhere). A large linear or an expert tensor that does not cut is refused
(:class:`FP8LayoutError`; the flags check says it first, in one line).

Forward goes through fp8/matmul.py: the input gradient only; ``local_linear(x)`` is the shard's product without
communication (model/mla.py's projections call it), ``dense_weight()`` the dequantised shard (the absorbed
attention's kv_b, dequantised per forward: one weight).
"""
from __future__ import annotations

import copy
import math
from typing import List, Tuple

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, \
    set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region, \
    gather_from_sequence_parallel_region

from megatron_glm5.errors import UserError
from megatron_glm5.fp8.flags import held_whole, shard_cuts
from megatron_glm5.fp8.blocks import BLOCK, FP8_DTYPE, SCALE_SUFFIX, dequantize_blocks, quantize_blocks
from megatron_glm5.fp8.matmul import fp8_grouped_linear, fp8_linear
from megatron_glm5.model.moe import GLM5GroupedExperts
from megatron_glm5.model.params import param_device



class FP8LayoutError(UserError, ValueError):
    """A parallel layout whose shards do not cut an FP8 weight on its 128x128 scale blocks."""


def _frozen(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t, requires_grad=False)


def _alloc(shape, device) -> Tuple[torch.nn.Parameter, torch.nn.Parameter]:
    """(q zeros, scale_inv ones) for a weight of ``shape`` [..., N, K] in 128x128 blocks."""
    *lead, n, k = shape
    q = torch.zeros(*lead, n, k, dtype=FP8_DTYPE, device=device)
    s = torch.ones(*lead, math.ceil(n / BLOCK), math.ceil(k / BLOCK), dtype=torch.float32, device=device)
    return _frozen(q), _frozen(s)


class _MetaWeightConfig:
    """Builds a megatron-core linear with its bf16 weight on the meta device and no initialisation: the parent's
    constructor sees a copy of the config (CPU-style allocation, so torch's default device applies)."""

    def __init__(self, config):
        self.config = copy.copy(config)
        self.config.use_cpu_initialization = True
        self.config.perform_initialization = False
        self._device = torch.device("meta")

    def __enter__(self):
        self._device.__enter__()
        return self.config

    def __exit__(self, *exc):
        return self._device.__exit__(*exc)


def _initialize(q: torch.Tensor, s: torch.Tensor, init_method, perform: bool) -> None:
    """Draw ``init_method``'s values one weight at a time (one expert at a time for 3-D) and quantise them."""
    if not perform or q.device.type == "meta":
        return
    with torch.no_grad():
        for i in range(q.shape[0] if q.dim() == 3 else 1):
            qi, si = (q[i], s[i]) if q.dim() == 3 else (q, s)
            values = torch.empty(qi.shape, dtype=torch.float32, device=qi.device)
            init_method(values)
            qi_new, si_new = quantize_blocks(values)
            qi.copy_(qi_new)
            si.copy_(si_new)


class _FP8Linear:
    """What the FP8 column- and row-parallel linears share (a mixin before the megatron-core class)."""

    PARTITION_DIM = 0
    ROW_GROUPS = 1  # fused weights: rows made of this many equal parts, each with its own block grid (gate | up)

    def _setup_fp8(self, config, full_shape: Tuple[int, int], tp: int, rank: int, init_method, what: str) -> None:
        if self.bias is not None:
            raise ValueError(f"{what}: the FP8 base has no bias (GLM-5's linears have none)")
        dim = self.PARTITION_DIM
        groups = self.ROW_GROUPS if dim == 0 else 1
        part = full_shape[dim] // groups
        local = part // tp
        self.fp8_replicated = held_whole(part, full_shape[0] * full_shape[1], tp)
        if not self.fp8_replicated and not shard_cuts(part, tp):
            raise FP8LayoutError(
                f"--base-precision fp8: {what} [{full_shape[0]}, {full_shape[1]}] splits its {part} "
                f"{'rows' if dim == 0 else 'columns'} over --tp {tp} into {local}, not a multiple of the FP8 "
                f"release's {BLOCK}-wide scale blocks; use a --tp that does")
        self.tp_size_fp8, self.tp_rank_fp8 = tp, rank
        shape = list(full_shape)
        if not self.fp8_replicated:
            shape[dim] = full_shape[dim] // tp
        if groups > 1:
            q = torch.zeros(*shape, dtype=FP8_DTYPE, device=param_device(config))
            s = torch.ones(groups * math.ceil(shape[0] // groups / BLOCK), math.ceil(shape[1] / BLOCK),
                           dtype=torch.float32, device=param_device(config))
            self.weight, self.weight_scale_inv = _frozen(q), _frozen(s)
        else:
            self.weight, self.weight_scale_inv = _alloc(shape, param_device(config))
        for t in (self.weight, self.weight_scale_inv):
            set_tensor_model_parallel_attributes(t, is_parallel=tp > 1 and not self.fp8_replicated, dim=dim, stride=1)
        if groups == 1:
            _initialize(self.weight, self.weight_scale_inv, init_method, config.perform_initialization)
        else:
            for g in range(groups):
                q, s = self._group(g)
                _initialize(q, s, init_method, config.perform_initialization)

    def _group(self, g: int) -> Tuple[torch.Tensor, torch.Tensor]:
        n = self.weight.shape[0] // self.ROW_GROUPS
        nb = self.weight_scale_inv.shape[0] // self.ROW_GROUPS
        return self.weight[g * n:(g + 1) * n], self.weight_scale_inv[g * nb:(g + 1) * nb]

    def _held_output(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W_held^T for the rows this rank holds (all rows when replicated)."""
        if self.ROW_GROUPS == 1 or (self.weight.shape[0] // self.ROW_GROUPS) % BLOCK == 0:
            return fp8_linear(x, self.weight, self.weight_scale_inv)
        return torch.cat([fp8_linear(x, *self._group(g)) for g in range(self.ROW_GROUPS)], dim=-1)

    def local_linear(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T with this rank's shard, no communication (what a bf16 shard's F.linear(x, weight) gives)."""
        if self.fp8_replicated and self.PARTITION_DIM == 1:  # this rank's input columns, zeros elsewhere
            k, r = self.weight.shape[1], self.tp_rank_fp8
            local = k // self.tp_size_fp8
            return self._held_output(F.pad(x, (r * local, k - (r + 1) * local)))
        y = self._held_output(x)
        if not self.fp8_replicated:
            return y
        n = y.shape[-1] // self.ROW_GROUPS
        local = n // self.tp_size_fp8
        return torch.cat([y[..., g * n + self.tp_rank_fp8 * local:g * n + (self.tp_rank_fp8 + 1) * local]
                          for g in range(self.ROW_GROUPS)], dim=-1)

    def dense_weight(self) -> torch.Tensor:
        """This rank's shard dequantised in params_dtype (a transient copy of one weight)."""
        dtype = self.config.params_dtype
        groups = [self._group(g) for g in range(self.ROW_GROUPS)]
        w = torch.cat([dequantize_blocks(q, s, dtype) for q, s in groups], dim=0)
        if not self.fp8_replicated:
            return w
        if self.PARTITION_DIM == 1:
            local = w.shape[1] // self.tp_size_fp8
            return w[:, self.tp_rank_fp8 * local:(self.tp_rank_fp8 + 1) * local]
        n = w.shape[0] // self.ROW_GROUPS
        local = n // self.tp_size_fp8
        r = self.tp_rank_fp8
        return torch.cat([w[g * n + r * local:g * n + (r + 1) * local] for g in range(self.ROW_GROUPS)], dim=0)

    def _forward_impl(self, input, weight, bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
                      sequence_parallel=False, tp_group=None, **_unused):
        """megatron-core's frozen-weight linear (its sequence-parallel gather, its input-gradient all-reduce) with
        the FP8 product."""
        if sequence_parallel:
            input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=tp_group)
        elif allreduce_dgrad:
            input = copy_to_tensor_model_parallel_region(input, group=tp_group)
        return self.local_linear(input)

    def _fp8_sharded_state_dict(self, prefix, sharded_offsets, metadata):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)  # weight, weight_scale_inv, _extra_state
        dims = {} if self.fp8_replicated else {"weight": self.PARTITION_DIM, "weight_scale_inv": self.PARTITION_DIM}
        out = make_sharded_tensors_for_checkpoint(state, prefix, dims, sharded_offsets, tp_group=self.tp_group,
                                                  dp_cp_group=metadata["dp_cp_group"])
        if self.ROW_GROUPS == 2:  # gate | up: stored as the two HF tensors' blocks, like megatron-core's fc1 weight
            from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

            key = prefix + "weight_scale_inv"
            out[key] = apply_swiglu_sharded_factory(out[key], sharded_offsets,
                                                    (metadata or {}).get("singleton_local_shards", False),
                                                    tp_group=self.tp_group, dp_group=metadata["dp_cp_group"])
        return out

    def extra_repr(self) -> str:
        return super().extra_repr() + f", fp8=e4m3 {BLOCK}x{BLOCK}" + (", replicated" if self.fp8_replicated else "")


def _tp(module) -> Tuple[int, int]:
    g = module.tp_group
    return (g.size(), g.rank()) if g is not None else (1, 0)


class FP8ColumnParallelLinear(_FP8Linear, ColumnParallelLinear):
    PARTITION_DIM = 0

    def __init__(self, input_size, output_size, *, config, init_method, **kwargs):
        with _MetaWeightConfig(config) as meta_config:
            ColumnParallelLinear.__init__(self, input_size, output_size, config=meta_config,
                                          init_method=init_method, **kwargs)
        self.config = config
        tp, rank = _tp(self)
        self._setup_fp8(config, (output_size, input_size), tp, rank, init_method,
                        kwargs.get("name") or "a column-parallel linear")

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return self._fp8_sharded_state_dict(prefix, sharded_offsets, metadata)


class FP8GatedColumnParallelLinear(FP8ColumnParallelLinear):
    """fc1 of a gated MLP: rows [gate; up], each half with its own block grid (the two HF tensors' scales)."""
    ROW_GROUPS = 2


class FP8RowParallelLinear(_FP8Linear, RowParallelLinear):
    PARTITION_DIM = 1

    def __init__(self, input_size, output_size, *, config, init_method, **kwargs):
        with _MetaWeightConfig(config) as meta_config:
            RowParallelLinear.__init__(self, input_size, output_size, config=meta_config, init_method=init_method,
                                       **kwargs)
        self.config = config
        tp, rank = _tp(self)
        self._setup_fp8(config, (output_size, input_size), tp, rank, init_method,
                        kwargs.get("name") or "a row-parallel linear")

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return self._fp8_sharded_state_dict(prefix, sharded_offsets, metadata)


class FP8GroupedExperts(GLM5GroupedExperts):
    """The routed experts in FP8: weight1 [E_local, 2, I_local, H] (gate, up) with weight1_scale_inv
    [E_local, 2, ceil(I_local/128), ceil(H/128)]; weight2 [E_local, H, I_local] with weight2_scale_inv
    [E_local, ceil(H/128), ceil(I_local/128)] — per expert exactly the HF tensors and their scales."""

    CHECKPOINT_TENSORS = (("weight1", 2), ("weight2", 2), ("weight1" + SCALE_SUFFIX, 2), ("weight2" + SCALE_SUFFIX, 2))

    def __init__(self, num_local_experts: int, config, pg_collection=None, name=None):
        with _MetaWeightConfig(config) as meta_config:
            super().__init__(num_local_experts, meta_config, pg_collection=pg_collection, name=name)
        self.config = config
        e, i, h = num_local_experts, self.ffn_local, config.hidden_size
        if self.etp > 1 and i % BLOCK:
            raise FP8LayoutError(
                f"--base-precision fp8: --etp {self.etp} splits moe_intermediate_size {config.moe_ffn_hidden_size} "
                f"into {i}, not a multiple of the FP8 release's {BLOCK}-row scale blocks; use a smaller --etp")
        device = param_device(config)
        self.weight1, self.weight1_scale_inv = _alloc((e, 2, i, h), device)
        self.weight2, self.weight2_scale_inv = _alloc((e, h, i), device)
        for w in (self.weight1, self.weight2, self.weight1_scale_inv, self.weight2_scale_inv):
            w.allreduce = False
            set_tensor_model_parallel_attributes(w, is_parallel=self.etp > 1, dim=2, stride=1)
        if config.perform_initialization:
            _initialize(self.weight1.view(2 * e, i, h), self.weight1_scale_inv.view(2 * e, -1, math.ceil(h / BLOCK)),
                        config.init_method, True)
            _initialize(self.weight2, self.weight2_scale_inv, config.output_layer_init_method, True)

    def _fc1_operands(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """(q, scale_inv) pairs whose outputs, concatenated, are [gate | up]: one fused [E, 2I, H] when I is whole
        blocks, else gate and up apart (their block grids restart at row I)."""
        e, i = self.num_local_experts, self.ffn_local
        if i % BLOCK == 0:
            return [(self.weight1.view(e, 2 * i, -1), self.weight1_scale_inv.view(e, 2 * (i // BLOCK), -1))]
        return [(self.weight1[:, g], self.weight1_scale_inv[:, g]) for g in range(2)]

    def linear_fc1(self, x: torch.Tensor, offsets: torch.Tensor, counts=None) -> torch.Tensor:
        outs = [fp8_grouped_linear(x, q, s, offsets=offsets, counts=counts) for q, s in self._fc1_operands()]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def linear_fc2(self, act: torch.Tensor, offsets: torch.Tensor, counts=None) -> torch.Tensor:
        return fp8_grouped_linear(act, self.weight2, self.weight2_scale_inv, offsets=offsets, counts=counts)


# ---------------------------------------------------------------- the spec's choice
def linear_classes(base_precision: str):
    """(column, gated column, row) linear classes of the frozen base's large matrices for ``--base-precision``."""
    if base_precision == "fp8":
        return FP8ColumnParallelLinear, FP8GatedColumnParallelLinear, FP8RowParallelLinear
    return ColumnParallelLinear, ColumnParallelLinear, RowParallelLinear


def experts_class(base_precision: str):
    return FP8GroupedExperts if base_precision == "fp8" else GLM5GroupedExperts


def is_fp8_module(module) -> bool:
    return isinstance(module, (_FP8Linear, FP8GroupedExperts))


def replace_down_projections(attention) -> None:
    """MLA's q_a / kv_a projections (megatron-core's MLASelfAttention accepts only its own classes there) rebuilt as
    FP8 linears of the same shape and parallel group; the bf16 weights the parent built are dropped at once."""
    for name in ("linear_q_down_proj", "linear_kv_down_proj"):
        old = getattr(attention, name, None)
        if old is None:
            continue
        new = FP8ColumnParallelLinear(old.input_size, old.output_size, config=attention.config,
                                      init_method=attention.config.init_method, bias=False, gather_output=False,
                                      skip_bias_add=False, tp_group=old.tp_group)
        setattr(attention, name, new)
        del old
