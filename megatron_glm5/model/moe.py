"""GLM-5's MoE pieces on megatron-core's MoELayer: the router and the grouped-GEMM experts.

Router (HF ``mlp.gate``): fp32 logits, sigmoid scores; the expert choice adds the aux-loss-free balancing bias
(HF ``e_score_correction_bias``, megatron ``expert_bias``, updated in finalize_model_grads) but the combine
weights do not; optional group-limited selection scores each group by the sum of its top-2 biased scores
(transformers' rule — megatron-core scores groups by the top topk/group_topk, which differs when that is not 2);
weights are normalised over the chosen experts (+1e-20) and scaled by routed_scaling_factor (2.5).

Layer: megatron-core's MoELayer; ``--dispatcher hybridep`` (not a megatron-core dispatcher type) becomes
megatron-core's flex dispatcher with its HybridEP backend when deep_ep is usable, else the torch.distributed
hierarchical dispatcher of model/hybridep_dispatcher.py.

``--moe-permute-fusion`` (on by default with CUDA and triton): the alltoall / allgather dispatchers run
megatron-core's own methods with ``permute`` / ``unpermute`` resolved to our Triton kernels
(ops/triton_moe_permute.py: one gather kernel, one deterministic per-token sum), the megatron-core patch
``moe_fused_permute`` (mcore_patches/moe_fused_permute.py; the flag itself: model/permute_fusion.py); the
hierarchical dispatcher (``--dispatcher hybridep`` without DeepEP) uses the same kernels for its two gathers and
two sums. The flex (DeepEP) dispatcher has its own.

Experts: all local experts' weights stacked in two tensors (HF layout: gate rows then up rows), applied with
torch's grouped GEMM (``torch.nn.functional.grouped_mm``); a per-expert loop where grouped_mm is unavailable.
"""
from __future__ import annotations

import copy
import functools
import logging

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import apply_router_token_dropping, compute_routing_scores_for_aux_loss
from megatron.core.transformer.moe.router import TopKRouter

from megatron_glm5.mcore_patches import registry as mcore_patches
from megatron_glm5.mcore_patches.moe_fused_permute import permutes_with_moe_utils
from megatron_glm5.model import fusions
from megatron_glm5.model.swiglu import swiglu
from megatron_glm5.model.hybridep_dispatcher import HierarchicalTokenDispatcher, hybridep_backend
from megatron_glm5.model.params import param_device
from megatron_glm5.model.permute_fusion import moe_permute_fusion_enabled


@fusions.region
def glm5_topk_routing(logits, expert_bias, topk: int, n_group: int, topk_group: int, norm_topk_prob: bool,
                      scaling_factor: float):
    """logits [N, E] (fp32) -> (probs [N, E] with the combine weight at chosen experts, routing_map [N, E] bool)."""
    n, e = logits.shape
    scores = torch.sigmoid(logits.float())
    choice = scores + expert_bias.float() if expert_bias is not None else scores
    if n_group > 1:
        group_scores = choice.view(n, n_group, e // n_group).topk(2, dim=-1).values.sum(-1)
        groups = group_scores.topk(topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        choice = choice.masked_fill(~keep.repeat_interleave(e // n_group, dim=1), float("-inf"))
    idx = choice.topk(topk, dim=-1, sorted=False).indices
    weights = scores.gather(1, idx)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * scaling_factor
    probs = torch.zeros_like(scores).scatter(1, idx, weights)
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, idx, True)
    return probs, routing_map


class GLM5Router(TopKRouter):
    """megatron-core's TopKRouter (gating, z-loss, aux losses, expert-bias bookkeeping) with GLM-5's top-k."""

    def reset_parameters(self):
        super().reset_parameters()
        # transformers keeps the router weight in fp32 whatever the model dtype (_keep_in_fp32_modules_strict)
        if self.config.fp32_router_and_indexer_weights:
            self.weight.data = self.weight.data.to(torch.float32)

    def routing(self, logits: torch.Tensor, padding_mask=None):
        cfg = self.config
        seq_length, bsz = logits.shape[:2]
        logits = logits.view(-1, cfg.num_moe_experts)
        if padding_mask is not None:
            padding_mask = padding_mask.reshape(-1)
        logits = self.apply_z_loss(logits, padding_mask=padding_mask)
        probs, routing_map = glm5_topk_routing(
            logits, self.expert_bias, self.topk, cfg.moe_router_num_groups or 1, cfg.moe_router_group_topk or 1,
            cfg.moe_norm_topk_prob, cfg.moe_router_topk_scaling_factor or 1.0, fuse=fusions.on(cfg, logits))
        probs = probs.to(logits.dtype)
        if cfg.moe_expert_capacity_factor is not None:
            probs, routing_map = apply_router_token_dropping(
                probs, routing_map, router_topk=self.topk, capacity_factor=cfg.moe_expert_capacity_factor,
                drop_policy=cfg.moe_token_drop_policy, pad_to_capacity=cfg.moe_pad_expert_input_to_capacity)
        if self.training and torch.is_grad_enabled() and self.is_aux_loss_enabled():
            map_aux, scores_aux = compute_routing_scores_for_aux_loss(
                logits, self.topk, self.score_function, fused=False, padding_mask=padding_mask)
            masked = padding_mask is not None
            probs = self._apply_aux_loss(probs, scores_aux, map_aux, with_padding_mask=masked)
            probs = self._apply_seq_aux_loss(probs, scores_aux, map_aux, seq_length, bsz, with_padding_mask=masked)
            probs = self._apply_global_aux_loss(probs, scores_aux, map_aux, with_padding_mask=masked)
        self._apply_expert_bias(routing_map, padding_mask=padding_mask)
        return probs, routing_map


def _grouped_mm_available() -> bool:
    return hasattr(F, "grouped_mm")


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (torch's grouped_mm backward rejects
    stride-0 gradients, e.g. the expanded gradient of a sum)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, counts: list[int] | None = None):
    """Per-expert x_e @ w_e^T for contiguous token groups. x [N, in], w [E, out, in], offsets = cumsum(counts)."""
    if _grouped_mm_available() and (x.is_cuda or x.dtype == torch.float32):
        return F.grouped_mm(_ContiguousGrad.apply(x), w.transpose(1, 2), offs=offsets)
    counts = counts if counts is not None else torch.diff(offsets, prepend=offsets.new_zeros(1)).tolist()
    return torch.cat([F.linear(chunk, w[e]) for e, chunk in enumerate(torch.split(x, counts))], dim=0)


def expert_offsets(tokens_per_expert, device) -> tuple:
    """(offsets = cumsum of the tokens per local expert, int32 on ``device``; the counts as a list, or None when
    they are a device tensor: offsets stay on the device, no host-GPU synchronisation)."""
    if torch.is_tensor(tokens_per_expert):
        return tokens_per_expert.to(device).cumsum(0).to(torch.int32), None
    counts = list(tokens_per_expert)
    return torch.tensor(counts, device=device).cumsum(0).to(torch.int32), counts


class GLM5GroupedExperts(MegatronModule):
    """The routed experts of one MoE layer (this rank's ``num_local_experts``).

    weight1 [E_local, 2, I_local, H]: [gate, up] (HF ``experts.{e}.gate_proj`` / ``up_proj``); weight2
    [E_local, H, I_local] (HF ``down_proj``). With expert tensor parallelism (etp) each rank holds I_local = I / etp
    of gate, up and down; keeping gate/up as their own axis lets checkpoints reshard over etp without reshuffling.
    Checkpoints name the global tensors [E, 2, I, H] and [E, H, I]: experts shard axis 0 over expert parallelism.
    """

    CHECKPOINT_TENSORS = (("weight1", 2), ("weight2", 2))  # (name, etp axis); the FP8 experts add their scales

    def __init__(self, num_local_experts: int, config, pg_collection=None, name=None):
        super().__init__(config=config)
        from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
        pg = pg_collection if pg_collection is not None else get_default_pg_collection()
        self.ep_group, self.etp_group, self.edp_group = pg.ep, pg.expt_tp, pg.expt_dp
        self.num_local_experts = num_local_experts
        self.etp = self.etp_group.size() if self.etp_group is not None else 1
        ffn = config.moe_ffn_hidden_size
        if ffn % self.etp:
            raise ValueError(f"--etp {self.etp} does not divide moe_intermediate_size {ffn}")
        self.ffn_local = ffn // self.etp
        kw = dict(dtype=config.params_dtype, device=param_device(config))
        self.weight1 = torch.nn.Parameter(torch.empty(num_local_experts, 2, self.ffn_local, config.hidden_size, **kw))
        self.weight2 = torch.nn.Parameter(torch.empty(num_local_experts, config.hidden_size, self.ffn_local, **kw))
        if config.perform_initialization:
            with tensor_parallel.get_cuda_rng_tracker().fork(tensor_parallel.random.get_expert_parallel_rng_tracker_name()):
                config.init_method(self.weight1)
                config.output_layer_init_method(self.weight2)
        for w, dim in ((self.weight1, 2), (self.weight2, 2)):
            w.allreduce = False  # expert-parallel: gradients reduce over the expert data-parallel group
            tensor_parallel.set_tensor_model_parallel_attributes(w, is_parallel=self.etp > 1, dim=dim, stride=1)

    def forward(self, permuted_hidden: torch.Tensor, tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor):
        offsets, counts = expert_offsets(tokens_per_expert, permuted_hidden.device)
        act = self.activation(self.linear_fc1(permuted_hidden, offsets, counts), permuted_probs)
        return self.linear_fc2(act, offsets, counts), None

    # the pieces of forward, also composed by the grouped LoRA (lora/grouped.py)
    def linear_fc1(self, x: torch.Tensor, offsets: torch.Tensor, counts=None) -> torch.Tensor:
        """[gate | up] of every token's expert: [N, H] -> [N, 2 * I_local]."""
        return grouped_linear(x, self.weight1.view(self.num_local_experts, 2 * self.ffn_local, -1), offsets, counts)

    def linear_fc2(self, act: torch.Tensor, offsets: torch.Tensor, counts=None) -> torch.Tensor:
        return grouped_linear(act, self.weight2, offsets, counts)

    def activation(self, h: torch.Tensor, permuted_probs: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up, weighted by the token's combine weight (model/swiglu.py; --fusions: our kernel)."""
        return swiglu(h, permuted_probs, fuse=fusions.on(self.config, h))

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        n = len(sharded_offsets)
        ep_rank = self.ep_group.rank() if self.ep_group is not None else 0
        ep_size = self.ep_group.size() if self.ep_group is not None else 1
        etp_rank = self.etp_group.rank() if self.etp_group is not None else 0
        replica = (0, 0, self.edp_group.rank() if self.edp_group is not None else 0)
        out = {}
        for name, tp_axis in self.CHECKPOINT_TENSORS:
            out[prefix + name] = ShardedTensor.from_rank_offsets(
                prefix + name, getattr(self, name), *sharded_offsets,
                (n, ep_rank, ep_size), (n + tp_axis, etp_rank, self.etp),
                replica_id=replica, prepend_axis_num=n)
        return out


logger = logging.getLogger("megatron_glm5.model")


@functools.lru_cache(maxsize=None)
def _log_permute_choice(dispatcher: str, fused: bool) -> None:
    """Once per process and choice: which token permute the MoE layers use."""
    logger.info("MoE token permute/unpermute (%s dispatcher): %s", dispatcher,
                "our fused Triton kernels (--moe-permute-fusion)" if fused
                else "megatron-core's unfused ops (--no-moe-permute-fusion, or no CUDA GPU / triton)")


class GLM5MoELayer(MoELayer):
    """megatron-core's MoELayer; with ``moe_token_dispatcher_type == "hybridep"`` the layer runs on a copy of
    the config that names what it really uses: ``flex`` + ``moe_flex_dispatcher_backend="hybridep"`` (DeepEP)
    or ``alltoall`` with the dispatcher replaced by :class:`HierarchicalTokenDispatcher` (same interface).
    With --moe-permute-fusion an alltoall / allgather dispatcher becomes a subclass that permutes with our kernels
    (patch ``moe_fused_permute``, mcore_patches/moe_fused_permute.py)."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, is_mtp_layer=False,
                 name=None):
        backend = hybridep_backend() if config.moe_token_dispatcher_type == "hybridep" else None
        if backend is not None:
            config = copy.copy(config)
            if backend == "deep_ep":
                config.moe_token_dispatcher_type, config.moe_flex_dispatcher_backend = "flex", "hybridep"
            else:
                config.moe_token_dispatcher_type = "alltoall"
        super().__init__(config, submodules, layer_number=layer_number, pg_collection=pg_collection,
                         is_mtp_layer=is_mtp_layer, name=name)
        if backend == "torch":  # it reads --moe-permute-fusion itself (its gathers and sums are its own)
            self.token_dispatcher = HierarchicalTokenDispatcher(
                self.num_local_experts, self.local_expert_indices, config=self.config, pg_collection=pg_collection)
            _log_permute_choice("hybridep (hierarchical)", self.token_dispatcher.fused)
        if permutes_with_moe_utils(type(self.token_dispatcher)):
            fused = moe_permute_fusion_enabled(getattr(self.config, "moe_triton_permute_fusion", None))
            _log_permute_choice(self.config.moe_token_dispatcher_type, fused)
            if fused:
                mcore_patches.apply("moe_fused_permute", self, pg_collection)
        mcore_patches.apply("moe_device_counts", self)  # one EP/TP rank: counts stay on the GPU, no host wait
