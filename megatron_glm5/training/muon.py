"""Muon for GLM-5: Newton-Schulz orthogonalised momentum, with GLM-5's per-head split of the MLA projections.

The rule (docs/muon.md says where it comes from and what was chosen where the report is not explicit):

- ``linear_q_up_proj`` (HF q_b_proj) [heads * (qk_head_dim + qk_pos_emb_head_dim), q_lora_rank]: one matrix per
  head, its qk_head_dim + qk_pos_emb_head_dim rows (nope and rope rows of a head together); ``linear_q_proj`` (no
  q LoRA) the same;
- ``linear_kv_up_proj`` (HF kv_b_proj) [heads * (qk_head_dim + v_head_dim), kv_lora_rank]: one matrix per head,
  its k_nope and v rows together;
- ``linear_proj`` (HF o_proj) [hidden, heads * v_head_dim]: one matrix per head, its v_head_dim input columns;
- the lightning indexer's ``linear_wq_b`` [index_heads * index_head_dim, q_lora_rank]: one matrix per indexer head;
- routed experts (GLM5GroupedExperts ``weight1`` [E, 2, I, H], ``weight2`` [E, H, I]): one matrix per expert,
  [gate; up] as one [2I, H] matrix like the dense MLP's fused linear_fc1;
- every other Muon parameter (2-D, not embedding / output head) is one matrix.

Under tensor parallelism the per-head blocks are this rank's heads (a block never straddles ranks, the projections
are sharded by heads on the split axis); a tensor-parallel matrix that is not split is gathered, orthogonalised
whole (as one process would) and sliced back.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_glm5.training.muon_flags import SCALE_MODES

# Keller Jordan's quintic Newton-Schulz coefficients (a, b, c): X <- a X + (b A + c A^2) X, A = X X^T.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(x: torch.Tensor, steps: int, eps: float = 1e-7) -> torch.Tensor:
    """The approximate orthogonal factor U V^T of each matrix of ``x`` [..., m, n] (fp32, batched)."""
    a, b, c = NS_COEFFICIENTS
    x = x.float()
    transpose = x.size(-2) > x.size(-1)
    if transpose:
        x = x.mT
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.mT if transpose else x


def scale_factor(rows: int, cols: int, mode: str, matched_adamw_rms: float) -> float:
    """The factor on an orthogonalised [rows, cols] update. ``matched_adamw_rms`` > 0: the update's RMS is that
    value (Moonlight: an orthogonal [rows, cols] matrix has RMS 1/sqrt(max(rows, cols))), and ``mode`` is unused."""
    if matched_adamw_rms > 0:
        return matched_adamw_rms * max(rows, cols) ** 0.5
    if mode == "spectral":
        return max(rows, cols) ** 0.5
    if mode == "shape_scaling":
        return max(1.0, rows / cols) ** 0.5
    if mode == "unit_rms_norm":
        return (rows / cols) ** 0.5
    raise ValueError(f"unknown Muon scale mode {mode!r}")


# ---------------------------------------------------------------------------------------------------------------
# The split rule: how a parameter's (full) gradient is cut into the matrices Newton-Schulz sees
# ---------------------------------------------------------------------------------------------------------------

ROWS, COLS, EXPERTS = "rows", "cols", "experts"


def split_of(name: str, param: torch.Tensor, config, split_heads: bool) -> Optional[Tuple[str, int]]:
    """(kind, block size) for a parameter named ``name`` (its model name), or None: one whole matrix."""
    if param.dim() in (3, 4) and name.endswith(("experts.weight1", "experts.weight2")):
        return (EXPERTS, 0)
    if not split_heads or param.dim() != 2:
        return None
    if name.endswith(("self_attention.linear_q_up_proj.weight", "self_attention.linear_q_proj.weight")):
        return (ROWS, config.qk_head_dim + config.qk_pos_emb_head_dim)
    if name.endswith("self_attention.linear_kv_up_proj.weight"):
        return (ROWS, config.qk_head_dim + config.v_head_dim)
    if name.endswith("self_attention.linear_proj.weight"):
        return (COLS, config.v_head_dim)
    if name.endswith("indexer.linear_wq_b.weight"):
        return (ROWS, config.dsa_index_head_dim)
    return None


def to_blocks(g: torch.Tensor, split: Optional[Tuple[str, int]]) -> torch.Tensor:
    """The matrices [n, rows, cols] of a gradient under ``split``."""
    if split is None:
        return g.reshape(1, *g.shape)
    kind, size = split
    if kind == EXPERTS:
        return g.reshape(g.size(0), -1, g.size(-1))
    if kind == ROWS:
        return g.reshape(g.size(0) // size, size, g.size(1))
    return g.reshape(g.size(0), g.size(1) // size, size).transpose(0, 1)  # COLS


def from_blocks(blocks: torch.Tensor, split: Optional[Tuple[str, int]], shape) -> torch.Tensor:
    if split is not None and split[0] == COLS:
        blocks = blocks.transpose(0, 1)
    return blocks.reshape(shape)


def orthogonalize(g: torch.Tensor, split, steps: int, scale_mode: str, matched_adamw_rms: float) -> torch.Tensor:
    """Newton-Schulz on each matrix of ``g`` under ``split``, each scaled by its own shape's factor."""
    blocks = to_blocks(g, split)
    out = newton_schulz(blocks, steps) * scale_factor(blocks.size(-2), blocks.size(-1), scale_mode,
                                                      matched_adamw_rms)
    return from_blocks(out, split, g.shape)


def _gather(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


# ---------------------------------------------------------------------------------------------------------------
# The optimizer
# ---------------------------------------------------------------------------------------------------------------


class GLM5Muon(torch.optim.Optimizer):
    """Muon: momentum (EMA, optionally Nesterov), decoupled weight decay, the update orthogonalised per matrix.

    Parameters carry ``muon_split`` (:func:`split_of`, set when the optimizer is built) and megatron-core's
    tensor-parallel attributes; ``tp_group_of(param)`` gives the group a tensor-parallel parameter is sharded over.
    """

    def __init__(self, params, lr: float = 3e-4, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.0, num_ns_steps: int = 5, scale_mode: str = "spectral",
                 matched_adamw_rms: float = 0.0, extra_scale_factor: float = 1.0,
                 tp_group_of: Optional[Callable[[torch.Tensor], object]] = None):
        if num_ns_steps < 1:
            raise ValueError(f"num_ns_steps must be at least 1, got {num_ns_steps}")
        if scale_mode not in SCALE_MODES:
            raise ValueError(f"unknown Muon scale mode {scale_mode!r}")
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                        num_ns_steps=num_ns_steps, scale_mode=scale_mode, matched_adamw_rms=matched_adamw_rms,
                        extra_scale_factor=extra_scale_factor)
        super().__init__(params, defaults)
        self.tp_group_of = tp_group_of

    def init_state(self) -> None:
        """A (zero) momentum buffer for every parameter (a checkpoint load needs the state before any step)."""
        for group in self.param_groups:
            for p in group["params"]:
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _update(self, p: torch.Tensor, u: torch.Tensor, group: dict) -> torch.Tensor:
        split = getattr(p, "muon_split", None)
        group_tp = self.tp_group_of(p) if self.tp_group_of is not None else None
        sharded = (getattr(p, "tensor_model_parallel", False) and group_tp is not None
                   and dist.get_world_size(group_tp) > 1)
        steps, mode, rms = group["num_ns_steps"], group["scale_mode"], group["matched_adamw_rms"]
        extra = group["extra_scale_factor"]
        if not sharded or (split is not None and split[0] in (ROWS, COLS)):
            # per-head blocks are whole on every rank (heads are sharded on the split axis)
            return orthogonalize(u, split, steps, mode, rms) * extra
        dim = p.partition_dim
        full = orthogonalize(_gather(u, dim, group_tp), split, steps, mode, rms) * extra
        rank = dist.get_rank(group_tp)
        return full.narrow(dim, rank * u.size(dim), u.size(dim))

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("GLM5Muon.step takes no closure")
        for group in self.param_groups:
            lr, momentum, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                if wd:
                    p.mul_(1.0 - lr * wd)
                buf.lerp_(p.grad, 1.0 - momentum)
                u = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                p.add_(self._update(p, u, group).to(p.dtype), alpha=-lr)
        return None
