"""The grouped LoRA of the routed experts: per expert e, fc1 gets (alpha/r) B1_e A1_e and fc2 (alpha/r) B2_e A2_e.

A1 [E, r, H], B1 [E, 2I, r] (gate rows then up rows, as the experts' weight1), A2 [E, r, I], B2 [E, H, r]: the
same layout as HF/PEFT's 3-D expert adapters. Applied to the tokens the experts already hold, permuted and
grouped by expert (model/moe.py ``linear_fc1`` / ``linear_fc2`` take the same offsets), each low-rank product is
one grouped GEMM over all local experts (torch ``grouped_mm``; a per-expert loop where it is unavailable, as
``grouped_linear`` does). Expert parallelism shards the experts: this rank holds its E_local experts' adapters,
reduced over the expert data-parallel group like the experts' weights. Expert tensor parallelism is refused
(flags.py).
"""
from __future__ import annotations

import functools

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from megatron_glm5.lora.adapters import LORA_PREFIX, new_adapter
from megatron_glm5.model.moe import expert_offsets, grouped_linear


class GroupedLoRA:
    """Mixin placed before GLM5GroupedExperts (or a frozen FP8 experts class with the same pieces)."""

    def attach(self, rank: int, alpha: float, dropout: float, fc1: bool, fc2: bool) -> None:
        e, hidden, ffn = self.num_local_experts, self.config.hidden_size, self.ffn_local
        dtype = self.config.params_dtype
        self.lora_scaling = alpha / rank
        self.lora_dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        self.lora_names = []
        if fc1:
            self.lora_a1 = new_adapter(self, (e, rank, hidden), dtype)
            self.lora_b1 = new_adapter(self, (e, 2 * ffn, rank), dtype)
            self.lora_names += ["lora_a1", "lora_b1"]
        if fc2:
            self.lora_a2 = new_adapter(self, (e, rank, ffn), dtype)
            self.lora_b2 = new_adapter(self, (e, hidden, rank), dtype)
            self.lora_names += ["lora_a2", "lora_b2"]
        for name in self.lora_names:
            getattr(self, name).allreduce = False  # expert-parallel: reduced over the expert data-parallel group

    def _delta(self, which: str, x, offsets, counts):
        a, b = getattr(self, f"lora_a{which}", None), getattr(self, f"lora_b{which}", None)
        if a is None:
            return None
        h = grouped_linear(self.lora_dropout(x), a, offsets, counts)
        return grouped_linear(h, b, offsets, counts) * self.lora_scaling

    def forward(self, permuted_hidden, tokens_per_expert, permuted_probs):
        offsets, counts = expert_offsets(tokens_per_expert, permuted_hidden.device)
        h = self.linear_fc1(permuted_hidden, offsets, counts)
        d1 = self._delta("1", permuted_hidden, offsets, counts)
        if d1 is not None:
            h = h + d1.to(h.dtype)
        act = self.activation(h, permuted_probs)
        out = self.linear_fc2(act, offsets, counts)
        d2 = self._delta("2", act, offsets, counts)
        if d2 is not None:
            out = out + d2.to(out.dtype)
        return out, None

    def lora_delta_weights(self) -> dict:
        """{"weight1": [E, 2, I, H], "weight2": [E, H, I]} deltas (alpha/r) B A of the adapted ones (merging)."""
        out = {}
        with torch.no_grad():
            if hasattr(self, "lora_a1"):
                d = torch.bmm(self.lora_b1.float(), self.lora_a1.float()) * self.lora_scaling
                out["weight1"] = d.view(self.num_local_experts, 2, self.ffn_local, -1)
            if hasattr(self, "lora_a2"):
                out["weight2"] = torch.bmm(self.lora_b2.float(), self.lora_a2.float()) * self.lora_scaling
        return out

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        base = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        out = {k: v for k, v in base.items() if not k[len(prefix):].startswith(LORA_PREFIX)}
        n = len(sharded_offsets)
        ep_rank = self.ep_group.rank() if self.ep_group is not None else 0
        ep_size = self.ep_group.size() if self.ep_group is not None else 1
        replica = (0, 0, self.edp_group.rank() if self.edp_group is not None else 0)
        for name in self.lora_names:
            out[prefix + name] = ShardedTensor.from_rank_offsets(
                prefix + name, getattr(self, name), *sharded_offsets, (n, ep_rank, ep_size),
                replica_id=replica, prepend_axis_num=n)
        return out


@functools.lru_cache(maxsize=None)
def grouped_lora_class(base_cls: type) -> type:
    return type(f"LoRA{base_cls.__name__}", (GroupedLoRA, base_cls), {"__module__": __name__})
