"""DeepSeek Sparse Attention as GLM-5 uses it: the lightning indexer, IndexShare and the indexer KL loss.

``GLM5Indexer`` holds a full layer's indexer weights (HF ``self_attn.indexer.*``). ``GLM5SparseAttention`` is the
``core_attention`` of GLM-5's MLA: it selects each query's top-k keys (its own indexer on "full" layers, the
top-k left in the per-forward store by the nearest earlier full layer on "shared" layers), runs sparse MLA in the
absorbed latent space through the selected attention backend, and attaches the indexer's training loss.

Training stages (``config.dsa_stage``):
- ``dense-warmup``: attention is dense (every causal key); the indexer learns to match the main attention's
  distribution over all keys. Only the indexer receives gradients from that loss.
- ``sparse``: attention sees only the top-k keys; the indexer loss is a KL over the selected keys.
The indexer always reads detached inputs, so its loss never reaches the main model; its loss is added to the
backward pass with megatron-core's MoEAuxLossAutoScaler (the schedule sets its scale like the MoE aux loss).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from megatron_glm5.config import DSA_STAGES
from megatron_glm5.model.params import param_device
from megatron_glm5.model import fusions
from megatron_glm5.model.rope import rope_prefix
from megatron_glm5.ops import get_backend
from megatron_glm5.ops.autotune import shape_from_config

MTP_STORE_KEY = "mtp"  # where the MTP layer's indexer leaves its top-k


class GLM5Indexer(MegatronModule):
    """The lightning indexer: per query ``Hi`` small heads scored against one shared key per token.

    score[t, j] = sum_h w[t, h] * relu(q[t, h] . k[j] / sqrt(Di)),  w = weights_proj(x) / sqrt(Hi)
    Weights are replicated over tensor-parallel ranks (the indexer is small and sees the whole sequence).
    """

    def __init__(self, config, layer_number=None):
        super().__init__(config=config)
        self.layer_number = layer_number  # names its key rows for generation's cache (AttentionInputs.gather_keys)
        hi, di = config.dsa_index_n_heads, config.dsa_index_head_dim
        self.n_heads, self.head_dim, self.rope_dim = hi, di, config.qk_pos_emb_head_dim
        dtype, device = config.params_dtype, param_device(config)
        self.linear_wq_b = torch.nn.Linear(config.q_lora_rank, hi * di, bias=False, dtype=dtype, device=device)
        self.linear_wk = torch.nn.Linear(config.hidden_size, di, bias=False, dtype=dtype, device=device)
        self.k_norm = torch.nn.LayerNorm(di, eps=config.latent_norm_eps, dtype=dtype, device=device)
        # transformers keeps weights_proj in fp32 (_keep_in_fp32_modules); so do we, except in training (see
        # GLM5TransformerConfig.fp32_router_and_indexer_weights). Its product is computed in fp32 either way.
        wdtype = torch.float32 if config.fp32_router_and_indexer_weights else dtype
        self.linear_weights_proj = torch.nn.Linear(config.hidden_size, hi, bias=False, dtype=wdtype, device=device)
        for lin in (self.linear_wq_b, self.linear_wk, self.linear_weights_proj):
            config.init_method(lin.weight)
        self.softmax_scale = di ** -0.5

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, inputs):
        """x [s, b, H], q_resid [s, b, q_lora] -> q [T, Hi, Di], weights [T, Hi] (fp32) of the T = b*s local
        queries and k [Tk, Di] of every key row (``inputs.gather_keys``: all-gathered over context parallelism)."""
        s, b, _ = x.shape
        cos, sin = inputs.cos, inputs.sin
        q = self.linear_wq_b(q_resid).view(s, b, self.n_heads, self.head_dim)
        k = self.k_norm(self.linear_wk(x))
        r = self.rope_dim
        fuse = fusions.on(self.config, x)
        q, k = rope_prefix(q, cos, sin, r, fuse=fuse), rope_prefix(k, cos, sin, r, fuse=fuse)
        w = F.linear(x.to(torch.float32), self.linear_weights_proj.weight.float()) * (self.n_heads ** -0.5)
        to_tokens = lambda t: t.transpose(0, 1).reshape(b * s, *t.shape[2:])
        return to_tokens(q), inputs.gather_keys(k, (self.layer_number, "index")), to_tokens(w)


class GLM5SparseAttention(MegatronModule):
    """MLA core attention with DSA. Built per layer from the spec with ``index_mode`` "full" or "shared".

    ``store_key``: where a full layer leaves its top-k in ``AttentionInputs.topk_store``; ``source_key``: which
    full layer a shared layer reuses. Both are fixed when the spec is built (megatron layer numbers, 1-based).
    """

    def __init__(self, config, layer_number: int, index_mode: str, store_key, source_key=None,
                 softmax_scale: float = None, pg_collection=None, **unused_megatron_kwargs):
        super().__init__(config=config)
        if index_mode not in ("full", "shared"):
            raise ValueError(f"index_mode must be 'full' or 'shared', got {index_mode!r}")
        if config.dsa_stage not in DSA_STAGES:
            raise ValueError(f"--dsa-stage must be one of {DSA_STAGES}, got {config.dsa_stage!r}")
        self.layer_number = layer_number
        self.index_mode, self.store_key, self.source_key = index_mode, store_key, source_key
        self.indexer = GLM5Indexer(config, layer_number) if index_mode == "full" else None
        if self.indexer is not None and config.dsa_freeze_indexer:
            self.indexer.requires_grad_(False)
        self.softmax_scale = softmax_scale
        self.backend = get_backend(config.dsa_backend, shape=shape_from_config(config))
        self.tp_group = pg_collection.tp if pg_collection is not None else parallel_state.get_tensor_model_parallel_group()
        self.last_indexer_loss = None  # mean KL per token of the last training forward (detached)
        self.kl_log = [0.0, 0]  # (sum of per-forward mean KL, forwards) since the trainer last reset it

    def _indexer_loss_enabled(self) -> bool:
        cfg = self.config
        return (self.indexer is not None and self.training and torch.is_grad_enabled()
                and cfg.dsa_indexer_loss_coeff > 0 and not cfg.dsa_freeze_indexer)

    def _head_sum_reduce(self):
        if self.tp_group is None or torch.distributed.get_world_size(self.tp_group) == 1:
            return None
        group = self.tp_group

        def all_reduce(t):
            torch.distributed.all_reduce(t, group=group)
            return t
        return all_reduce

    def forward(self, q, kv, x, q_resid, inputs):
        """q [T, h, Dqk] (absorbed) of the local queries, kv [Tk, Dqk] latent|rope of every key row (all CP ranks'
        tokens in global order, see AttentionInputs); x [s, b, H], q_resid [s, b, q_lora] local, detached.

        Returns the latent attention output [T, h, kv_lora_rank].
        """
        cfg = self.config
        sparse = cfg.dsa_stage == "sparse"
        with_loss = self._indexer_loss_enabled()
        topk = inputs.topk_width(cfg.dsa_index_topk)

        indices = None
        if (self.indexer is not None and cfg.dsa_mtp_indexer_shared and self.store_key == MTP_STORE_KEY
                and inputs.mtp_step > 0 and sparse):
            # index_share_for_mtp_iteration: later steps of the (repeated) MTP layer reuse the first step's top-k
            with_loss = False
            indices = inputs.topk_store[self.store_key]
        elif self.indexer is not None and (sparse or with_loss):
            with torch.set_grad_enabled(with_loss):
                q_idx, k_idx, w_idx = self.indexer(x, q_resid, inputs)
            if sparse:
                indices = self.backend.indexer_topk(
                    q_idx.detach(), k_idx.detach(), w_idx.detach(), topk, inputs.key_start, inputs.query_end,
                    self.indexer.softmax_scale, chunk_size=cfg.dsa_chunk_size)
                inputs.topk_store[self.store_key] = indices
        elif self.indexer is None and sparse:
            if self.source_key not in inputs.topk_store:
                raise RuntimeError(
                    f"IndexShare layer {self.layer_number} needs the top-k of full layer {self.source_key}, "
                    "which did not run before it in this forward")
            indices = inputs.topk_store[self.source_key]

        # the Triton backend computes the sparse KL in the backward, from its sparse-MLA backward's head sums
        # (ops/deferred_kl.py): kl_job.token stands for the loss below and is attached the same way
        kl_job = None if not with_loss else self.backend.deferred_indexer_kl(
            q_idx, k_idx, w_idx, self.indexer.softmax_scale, q, cfg.kv_lora_rank, indices,
            head_sum_reduce=self._head_sum_reduce(), per_token=cfg.calculate_per_token_loss,
            on_value=self._record_indexer_loss)
        out, lse = self.backend.sparse_mla(q, kv, indices, self.softmax_scale, cfg.kv_lora_rank,
                                            key_start=inputs.key_start, query_end=inputs.query_end,
                                            chunk_size=cfg.dsa_chunk_size, **({"kl_job": kl_job} if kl_job else {}))
        if kl_job is not None:
            out = MoEAuxLossAutoScaler.apply(out, cfg.dsa_indexer_loss_coeff * kl_job.token)
        elif with_loss:
            kl_sum, n_tokens = self.backend.indexer_kl_loss(
                q_idx, k_idx, w_idx, self.indexer.softmax_scale, q.detach(), kv.detach(), self.softmax_scale,
                inputs.key_start, inputs.query_end, indices=indices, head_sum_reduce=self._head_sum_reduce(),
                chunk_size=cfg.dsa_chunk_size, attn_lse=None if indices is None else lse.detach())
            # n_tokens: an int, or a device tensor (the Triton backend avoids a host-GPU synchronisation)
            kl = kl_sum / (n_tokens.clamp_min(1) if torch.is_tensor(n_tokens) else max(n_tokens, 1))
            self._record_indexer_loss(kl)
            # With per-token loss the trainer divides every gradient by the step's token count (as for the LM
            # loss, a sum over tokens): hand it the sum here, the mean otherwise.
            aux = kl_sum if cfg.calculate_per_token_loss else kl
            out = MoEAuxLossAutoScaler.apply(out, cfg.dsa_indexer_loss_coeff * aux)
        return out

    def _record_indexer_loss(self, kl: torch.Tensor) -> None:
        """The mean KL per token of a training forward (the deferred KL: of its backward), for the trainer's log."""
        self.last_indexer_loss = kl.detach()
        self.kl_log[0] = self.kl_log[0] + self.last_indexer_loss  # stays on device: no sync per forward
        self.kl_log[1] += 1
