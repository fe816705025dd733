"""Pure-torch reference implementation of the GLM-5 / DSA attention ops.

No megatron import here: this module only needs torch.  It is the "torch" attention backend (torch_backend.py) and the
oracle the GPU kernels are checked against.

Layout: token-flattened ("varlen"), the layout sparse kernels (FlashMLA, cuDNN) use.  Batches and packed documents
are flattened into T query tokens and Tk key tokens.  For every query token t the caller passes ``key_start[t]`` and
``query_end[t]`` (int64): the keys t may see are exactly the key rows j with key_start[t] <= j <= query_end[t].
Selected-key indices are global rows of the key tensor (int32), -1 marks an unused slot.

Numerics: everything is computed in fp32 (float64 when an input is float64, so that tests can compare with float64
oracles); outputs come back in q's dtype, except lse and losses which stay in the compute dtype (fp32 / float64).

Memory: no function here allocates a [T, Tk] or [T, H, Tk] tensor.  Queries are processed in chunks; for the window
("dense") key sets a chunk only looks at the key range [min key_start, max query_end] of its rows, and the chunk is
shrunk until chunk_rows * key_range * heads <= CHUNK_BUDGET elements.  For selected-key ("sparse") sets a chunk
gathers its [chunk, topk, D] keys.  Autograd is memory-lean: sparse_mla is a torch.autograd.Function that saves only
q, kv, indices/windows and lse and recomputes the probabilities chunk by chunk in backward; indexer_kl_loss returns a
scalar whose gradients (only to the indexer inputs) are produced chunk by chunk in the same pass as the loss, so
nothing of size O(T * keys) outlives a chunk.

The last section holds the naive full-matrix oracles used by the tests.
"""

from __future__ import annotations

import weakref
from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor

from . import host_windows

#: the one dtype of top-k index tensors [T, width] (global key rows, -1 in unused slots): every producer (the
#: backends' indexer_topk, the pipeline stages' receive buffer in model/pipeline_topk.py) makes or casts to it
TOPK_DTYPE = torch.int32

__all__ = [
    "CHUNK_BUDGET",
    "indexer_topk",
    "sparse_mla",
    "indexer_kl_loss",
    "indexer_scores_naive",
    "indexer_topk_naive",
    "sparse_mla_naive",
    "indexer_kl_loss_naive",
    "window_mask_naive",
    "indices_mask_naive",
]

# Largest number of elements of one per-chunk intermediate ([chunk, heads, keys] scores and the like).  A module
# attribute so that callers (and tests) can tune it; 2**24 elements = 64 MiB in fp32.
CHUNK_BUDGET = 1 << 24
# Default (and maximum automatic) number of query tokens per chunk.
DEFAULT_CHUNK = 1024

_NEG_INF = float("-inf")


# ----------------------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------------------


def _compute_dtype(*tensors: Optional[Tensor]) -> torch.dtype:
    """fp32, or float64 when any floating input is float64."""
    for t in tensors:
        if t is not None and t.dtype == torch.float64:
            return torch.float64
    return torch.float32


class _Windows:
    """Host copy of the per-query key windows, used to plan chunks (one device->host copy per call)."""

    def __init__(self, key_start: Tensor, query_end: Tensor, n_queries: int, n_keys: int):
        if key_start is None or query_end is None:
            raise ValueError("key_start and query_end are required for window (dense) key sets")
        ks = key_start.detach().reshape(-1).to("cpu", torch.int64)
        qe = query_end.detach().reshape(-1).to("cpu", torch.int64)
        if ks.numel() != n_queries or qe.numel() != n_queries:
            raise ValueError(
                f"key_start/query_end must have one entry per query token ({n_queries}), "
                f"got {ks.numel()} and {qe.numel()}"
            )
        nonempty = qe >= ks
        self.n_valid = torch.where(nonempty, qe - ks + 1, torch.zeros_like(ks))
        self._on_device = {}
        # empty rows must not widen a chunk's key range
        self._lo = torch.where(nonempty, ks, torch.full_like(ks, n_keys))
        self._hi = torch.where(nonempty, qe, torch.full_like(qe, -1))
        # checked on _lo / _hi (empty rows hold n_keys / -1 there): no boolean indexing, which took 3-6 ms of host
        # time per step on the H200's host at the start of a step (docs/performance.md, session 9)
        if ks.numel() and (int(self._lo.min()) < 0 or int(self._hi.max()) >= n_keys):
            raise ValueError(f"key windows [key_start, query_end] must lie inside the {n_keys} key rows")

    @property
    def row_hi(self) -> Tensor:
        """Host int64 [T]: each query's last key (-1 for an empty window)."""
        return self._hi

    def span(self, c0: int, c1: int) -> Tuple[int, int]:
        return int(self._lo[c0:c1].min()), int(self._hi[c0:c1].max())

    def n_valid_on(self, device) -> Tensor:
        """n_valid on ``device`` (copied once per device)."""
        key = str(device)
        if key not in self._on_device:
            self._on_device[key] = host_windows.to_device(self.n_valid, device)  # async: no host wait
        return self._on_device[key]


_last_windows: Optional[tuple] = None


def windows(key_start: Tensor, query_end: Tensor, n_queries: int, n_keys: int) -> _Windows:
    """``_Windows`` of these tensors, reused while the same (unmodified) tensors come back: every DSA layer of a
    forward passes the step's one key_start / query_end, so the device -> host copy (a host-GPU synchronisation)
    happens once per step instead of once per layer and op."""
    global _last_windows
    key_start, query_end = host_windows.host_copy(key_start), host_windows.host_copy(query_end)
    versions = (getattr(key_start, "_version", None), getattr(query_end, "_version", None), n_queries, n_keys)
    if _last_windows is not None:
        ks_ref, qe_ref, seen, win = _last_windows
        if ks_ref() is key_start and qe_ref() is query_end and seen == versions:
            return win
    win = _Windows(key_start, query_end, n_queries, n_keys)
    if isinstance(key_start, Tensor) and isinstance(query_end, Tensor):
        _last_windows = (weakref.ref(key_start), weakref.ref(query_end), versions, win)
    return win


def _dense_plan(win: _Windows, n_queries: int, chunk: int, per_key: int) -> List[Tuple[int, int, int, int]]:
    """Chunks (c0, c1, lo, hi) of queries with their key range; chunk rows * range * per_key <= CHUNK_BUDGET
    (a single row may exceed it).  Chunks whose rows all have empty windows are left out."""
    plan = []
    c0 = 0
    chunk = max(1, int(chunk))
    while c0 < n_queries:
        rows = min(chunk, n_queries - c0)
        while True:
            lo, hi = win.span(c0, c0 + rows)
            width = hi - lo + 1
            if rows == 1 or width <= 0 or rows * width * per_key <= CHUNK_BUDGET:
                break
            rows = max(1, min(rows // 2, CHUNK_BUDGET // max(1, width * per_key)))
        if width > 0:
            plan.append((c0, c0 + rows, lo, hi))
        c0 += rows
    return plan


def _sparse_plan(n_queries: int, width: int, chunk: int, per_key: int) -> List[Tuple[int, int, int, int]]:
    rows = max(1, min(int(chunk), CHUNK_BUDGET // max(1, width * per_key)))
    return [(c0, min(c0 + rows, n_queries), 0, -1) for c0 in range(0, n_queries, rows)]


def _check_indices(indices: Tensor, n_queries: int, n_keys: int) -> None:
    if indices.dim() != 2 or indices.shape[0] != n_queries:
        raise ValueError(f"indices must be [T={n_queries}, topk], got {tuple(indices.shape)}")
    if indices.dtype.is_floating_point:
        raise ValueError("indices must be an integer tensor")
    if indices.numel() and (int(indices.max()) >= n_keys or int(indices.min()) < -1):
        raise ValueError(f"indices must be -1 or rows of the key tensor (< {n_keys})")


class _KeySet:
    """The keys of one query chunk: a contiguous window range shared by the chunk's rows ("dense"), or per-row
    gathered selected keys ("sparse").  mask [C, n] says which (row, key) pairs are allowed."""

    def __init__(self, c0, c1, lo, hi, indices, key_start, query_end):
        self.c0, self.c1 = c0, c1
        if indices is None:
            self.lo, self.n = lo, hi - lo + 1
            self.idx = None
            device = key_start.device
            j = torch.arange(lo, hi + 1, device=device, dtype=torch.int64)
            ks = key_start[c0:c1].to(torch.int64)
            qe = query_end[c0:c1].to(torch.int64)
            self.mask = (j[None, :] >= ks[:, None]) & (j[None, :] <= qe[:, None])
        else:
            idx = indices[c0:c1].to(torch.int64)
            self.mask = idx >= 0
            self.idx = idx.clamp(min=0)
            self.lo, self.n = 0, idx.shape[1]

    def take(self, x: Tensor, dtype: torch.dtype) -> Tensor:
        """Rows of a key-indexed tensor x [Tk, ...]: [n, ...] (dense) or [C, n, ...] (sparse)."""
        if self.idx is None:
            return x[self.lo:self.lo + self.n].to(dtype)
        c, n = self.idx.shape
        return x.index_select(0, self.idx.reshape(-1)).to(dtype).reshape(c, n, *x.shape[1:])

    def outer(self, coef: Tensor, rows: Tensor) -> Tensor:
        """sum over (chunk rows, heads) of coef[c, h, k] * rows[c, h, :]: [n, D] (dense) or per row [C, n, D]."""
        if self.idx is None:
            c, h, n = coef.shape
            return coef.reshape(c * h, n).mT @ rows.reshape(c * h, rows.shape[-1])
        return coef.mT @ rows

    def add_into(self, dst: Tensor, g: Tensor) -> None:
        if self.idx is None:
            dst[self.lo:self.lo + self.n] += g
        else:
            dst.index_add_(0, self.idx.reshape(-1), g.reshape(-1, g.shape[-1]))


def _plan_for(n_queries, n_keys, indices, key_start, query_end, chunk_size, per_key):
    if indices is not None:
        _check_indices(indices, n_queries, n_keys)
        return _sparse_plan(n_queries, indices.shape[1], chunk_size, per_key)
    win = windows(key_start, query_end, n_queries, n_keys)
    return _dense_plan(win, n_queries, chunk_size, per_key)


def _masked_softmax(s: Tensor, mask: Tensor) -> Tuple[Tensor, Tensor]:
    """Softmax over the last dim restricted to mask (broadcast to s); rows without an allowed entry give p = 0 and
    lse = -inf.  Returns (p, lse) with lse lacking the last dim."""
    s = s.masked_fill(~mask, _NEG_INF)
    m = s.amax(dim=-1, keepdim=True)
    m = m.masked_fill(m == _NEG_INF, 0.0)
    e = torch.exp(s - m)
    den = e.sum(dim=-1, keepdim=True)
    lse = (m + torch.log(den)).squeeze(-1)
    p = e / torch.where(den > 0, den, torch.ones_like(den))
    return p, lse


def _index_logits(qi: Tensor, keys: Tensor, w: Tensor, scale: float) -> Tuple[Tensor, Tensor]:
    """a = scale * qi . k  [C, Hi, n]; z = sum_h w_h relu(a_h)  [C, n]."""
    a = (qi @ keys.mT) * scale
    z = (w.unsqueeze(1) @ torch.relu(a)).squeeze(1)
    return a, z


# ----------------------------------------------------------------------------------------------------------------------
# 1. lightning-indexer top-k
# ----------------------------------------------------------------------------------------------------------------------


def _deterministic_topk(scores: Tensor, k: int) -> Tensor:
    """Positions [C, k] of the k largest entries of each row of scores [C, n], ordered by descending score then
    ascending position; ties at the k-th value go to the smaller positions.  Bitwise reproducible (does not depend
    on torch.topk's index order, only on its values)."""
    c, n = scores.shape
    kth = torch.topk(scores, k, dim=-1, largest=True, sorted=False).values.amin(dim=-1, keepdim=True)
    greater = scores > kth
    equal = scores == kth
    need = k - greater.sum(dim=-1, keepdim=True)
    chosen = greater | (equal & (torch.cumsum(equal, dim=-1) <= need))
    pos = chosen.nonzero()[:, 1].reshape(c, k)  # ascending positions, exactly k per row
    order = torch.sort(scores.gather(1, pos), dim=-1, descending=True, stable=True).indices
    return pos.gather(1, order)


@torch.no_grad()
def indexer_topk(
    q_idx: Tensor,
    k_idx: Tensor,
    weights: Tensor,
    topk: int,
    key_start: Tensor,
    query_end: Tensor,
    softmax_scale: float,
    chunk_size: int = DEFAULT_CHUNK,
) -> Tensor:
    """DSA lightning-indexer selection.

    q_idx [T, Hi, Di], k_idx [Tk, Di], weights [T, Hi] (already scaled by Hi**-0.5).  Index score
    s[t, j] = sum_h weights[t, h] * relu(softmax_scale * q_idx[t, h] . k_idx[j]) in fp32, over the window
    key_start[t] <= j <= query_end[t].  Returns int32 [T, topk]: the min(topk, window) best keys as global key rows,
    by descending score then ascending row (ties -> smaller row, deterministic), padded with -1.
    """
    if q_idx.dim() != 3 or k_idx.dim() != 2 or weights.dim() != 2:
        raise ValueError("expected q_idx [T, Hi, Di], k_idx [Tk, Di], weights [T, Hi]")
    n_q, n_heads, _ = q_idx.shape
    n_k = k_idx.shape[0]
    topk = int(topk)
    out = torch.full((n_q, topk), -1, dtype=TOPK_DTYPE, device=q_idx.device)
    if n_q == 0 or topk <= 0:
        return out
    cdt = _compute_dtype(q_idx, k_idx, weights)
    win = windows(key_start, query_end, n_q, n_k)
    n_valid = win.n_valid.to(q_idx.device)
    for c0, c1, lo, hi in _dense_plan(win, n_q, chunk_size, n_heads + 2):
        keys = _KeySet(c0, c1, lo, hi, None, key_start, query_end)
        _, z = _index_logits(q_idx[c0:c1].to(cdt), keys.take(k_idx, cdt), weights[c0:c1].to(cdt), softmax_scale)
        # +0.0 turns -0.0 into +0.0 so that equal scores are equal bit patterns for any sort implementation
        z = z.masked_fill(~keys.mask, _NEG_INF) + 0.0
        k = min(topk, keys.n)
        pos = _deterministic_topk(z, k)
        slot = torch.arange(k, device=pos.device)
        sel = torch.where(slot[None, :] < n_valid[c0:c1, None], pos + lo, torch.full_like(pos, -1))
        out[c0:c1, :k] = sel.to(TOPK_DTYPE)
    return out


# ----------------------------------------------------------------------------------------------------------------------
# 2. sparse (and dense) MLA in the absorbed latent space
# ----------------------------------------------------------------------------------------------------------------------


def _mla_forward(q, kv, indices, key_start, query_end, plan, scale, d_v, cdt):
    n_q, n_heads, _ = q.shape
    out = torch.zeros(n_q, n_heads, d_v, dtype=q.dtype, device=q.device)
    lse = torch.full((n_q, n_heads), _NEG_INF, dtype=cdt, device=q.device)
    for c0, c1, lo, hi in plan:
        keys = _KeySet(c0, c1, lo, hi, indices, key_start, query_end)
        kc = keys.take(kv, cdt)
        s = (q[c0:c1].to(cdt) @ kc.mT) * scale  # [C, H, n]
        p, lse_c = _masked_softmax(s, keys.mask.unsqueeze(1))
        out[c0:c1] = (p @ kc[..., :d_v]).to(q.dtype)
        lse[c0:c1] = lse_c
    return out, lse


def _mla_backward(q, kv, indices, key_start, query_end, lse, d_out, d_lse, plan, scale, d_v, cdt):
    dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
    dkv = torch.zeros(kv.shape, dtype=cdt, device=kv.device)
    # rows without keys: lse = -inf; use +inf so that exp(s - lse) = 0 there
    lse_safe = lse.masked_fill(lse == _NEG_INF, float("inf"))
    for c0, c1, lo, hi in plan:
        keys = _KeySet(c0, c1, lo, hi, indices, key_start, query_end)
        kc = keys.take(kv, cdt)
        vc = kc[..., :d_v]
        qc = q[c0:c1].to(cdt)
        s = (qc @ kc.mT) * scale
        s = s.masked_fill(~keys.mask.unsqueeze(1), _NEG_INF)
        p = torch.exp(s - lse_safe[c0:c1].unsqueeze(-1))  # [C, H, n]
        del s
        do = d_out[c0:c1].to(cdt)
        dp = do @ vc.mT  # [C, H, n]
        delta = (p * dp).sum(dim=-1, keepdim=True)  # = dO . out, exactly, from this chunk
        if d_lse is not None:
            delta = delta - d_lse[c0:c1].to(cdt).unsqueeze(-1)
        ds = p * (dp - delta) * scale
        del dp
        dq[c0:c1] = ds @ kc
        g = keys.outer(ds, qc)
        g[..., :d_v] += keys.outer(p, do)
        keys.add_into(dkv, g)
    return dq.to(q.dtype), dkv.to(kv.dtype)


class _SparseMLAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, indices, key_start, query_end, scale, d_v, plan):
        cdt = _compute_dtype(q, kv)
        out, lse = _mla_forward(q, kv, indices, key_start, query_end, plan, scale, d_v, cdt)
        ctx.save_for_backward(q, kv, indices, key_start, query_end, lse)
        ctx.scale, ctx.d_v, ctx.plan, ctx.cdt = scale, d_v, plan, cdt
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, kv, indices, key_start, query_end, lse = ctx.saved_tensors
        if indices is not None:
            key_start = query_end = None
        if d_out is None:
            d_out = torch.zeros(q.shape[0], q.shape[1], ctx.d_v, dtype=q.dtype, device=q.device)
        dq, dkv = _mla_backward(
            q, kv, indices, key_start, query_end, lse, d_out, d_lse, ctx.plan, ctx.scale, ctx.d_v, ctx.cdt
        )
        return dq, dkv, None, None, None, None, None, None


def sparse_mla(
    q: Tensor,
    kv: Tensor,
    indices: Optional[Tensor],
    softmax_scale: float,
    d_v: int,
    key_start: Optional[Tensor] = None,
    query_end: Optional[Tensor] = None,
    chunk_size: Optional[int] = None,
) -> Tuple[Tensor, Tensor]:
    """MLA in the absorbed latent space: MQA of q [T, H, D] against one shared latent head kv [Tk, D], values
    v = kv[:, :d_v].

    indices [T, K] (int, -1 = unused slot, no duplicates within a row): attend to those key rows only.
    indices None: dense attention over the window key_start[t] <= j <= query_end[t].
    Returns out [T, H, d_v] (q's dtype) and lse [T, H] (fp32; float64 for float64 inputs) of the scaled scores.
    A row without any key gives out = 0, lse = -inf and zero gradients.  Gradients flow to q and kv (the value
    part of kv receives both contributions); probabilities are recomputed per chunk in backward.
    chunk_size: query tokens per chunk (None: automatic, <= 1024, bounded by CHUNK_BUDGET).
    """
    if q.dim() != 3 or kv.dim() != 2 or q.shape[-1] != kv.shape[-1]:
        raise ValueError(f"expected q [T, H, D] and kv [Tk, D], got {tuple(q.shape)} and {tuple(kv.shape)}")
    if not 0 < d_v <= kv.shape[-1]:
        raise ValueError(f"d_v={d_v} must be in (0, {kv.shape[-1]}]")
    n_q, n_heads, dim = q.shape
    chunk = DEFAULT_CHUNK if chunk_size is None else chunk_size
    if indices is not None:
        # the sparse path gathers [chunk, K, D] keys and builds [chunk, H, K] scores
        plan = _plan_for(n_q, kv.shape[0], indices, None, None, chunk, max(dim, n_heads))
        key_start = query_end = None
    else:
        plan = _plan_for(n_q, kv.shape[0], None, key_start, query_end, chunk, n_heads)
    return _SparseMLAFunction.apply(q, kv, indices, key_start, query_end, float(softmax_scale), int(d_v), plan)


# ----------------------------------------------------------------------------------------------------------------------
# 3. indexer KL loss (DSA warm-up / sparse adaptation)
# ----------------------------------------------------------------------------------------------------------------------


class _IndexerKLFunction(torch.autograd.Function):
    """Scalar KL sum; its gradients (to q_idx, k_idx, weights only) are computed chunk by chunk in forward, where the
    target distribution is at hand, and scaled by the incoming gradient in backward."""

    @staticmethod
    def forward(ctx, q_idx, k_idx, weights, kl_sum, d_q_idx, d_k_idx, d_weights):
        ctx.save_for_backward(d_q_idx, d_k_idx, d_weights)
        return kl_sum.clone()

    @staticmethod
    def backward(ctx, g):
        d_q_idx, d_k_idx, d_weights = ctx.saved_tensors
        return (
            None if d_q_idx is None else (d_q_idx * g).to(d_q_idx.dtype),
            None if d_k_idx is None else (d_k_idx * g).to(d_k_idx.dtype),
            None if d_weights is None else (d_weights * g).to(d_weights.dtype),
            None,
            None,
            None,
            None,
        )


def counted_queries(has_keys: Tensor, token_mask: Optional[Tensor]) -> Tensor:
    """[T] bool: the queries the indexer KL loss counts (they have keys and are not masked out)."""
    if token_mask is None:
        return has_keys
    return has_keys & token_mask.to(has_keys.device, torch.bool).reshape(-1)


def kl_accumulators(q_idx, k_idx, weights, has_keys, token_mask, need_grad: bool, cdt):
    """Shared set-up of the chunked indexer KL loss: which queries count (have keys and are not masked), on the
    device and on the host, their number, and zero accumulators for the loss and, when needed, the indexer gradients."""
    dev = q_idx.device
    counted = counted_queries(has_keys, token_mask)
    counted_host = counted.cpu()
    zeros = lambda t: torch.zeros(t.shape, dtype=cdt, device=dev) if need_grad else None
    return (counted, counted_host, int(counted_host.sum()), torch.zeros((), dtype=cdt, device=dev),
            zeros(q_idx), zeros(k_idx), zeros(weights))


def indexer_kl_loss(
    q_idx: Tensor,
    k_idx: Tensor,
    weights: Tensor,
    idx_softmax_scale: float,
    q: Tensor,
    kv: Tensor,
    attn_softmax_scale: float,
    key_start: Optional[Tensor],
    query_end: Optional[Tensor],
    indices: Optional[Tensor] = None,
    token_mask: Optional[Tensor] = None,
    head_sum_reduce: Optional[Callable[[Tensor], Tensor]] = None,
    chunk_size: Optional[int] = None,
) -> Tuple[Tensor, int]:
    """DSA indexer training loss: sum over counted tokens of KL(target || indexer).

    Key set of token t: its window (indices None, dense warm-up) or its selected keys indices[t] (sparse stage,
    -1 ignored).  target = sum_h softmax_j(attn_softmax_scale * q[t, h] . kv[j]), L1-normalised (head_sum_reduce,
    if given, is applied to the per-chunk head sums [chunk, n_keys] before normalising, e.g. a TP all-reduce; it is
    called once per chunk, the chunk plan depending only on shapes/windows so ranks stay in lockstep).  Never
    receives gradient.  indexer = softmax_j(sum_h weights[t, h] relu(idx_softmax_scale * q_idx[t, h] . k_idx[j])).
    token_mask [T] bool selects the counted tokens (None: all); tokens without any key never count.
    Returns (kl_sum fp32 scalar -- float64 for float64 inputs --, n_tokens).  Gradients reach q_idx, k_idx,
    weights only.
    """
    n_q, n_heads, dim = q.shape
    n_k = kv.shape[0]
    idx_heads, idx_dim = q_idx.shape[1], q_idx.shape[2]
    if k_idx.shape[0] != n_k or q_idx.shape[0] != n_q or weights.shape != (n_q, idx_heads):
        raise ValueError("inconsistent shapes between q_idx/k_idx/weights and q/kv")
    cdt = _compute_dtype(q_idx, k_idx, weights, q, kv)
    dev = q_idx.device
    need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q_idx, k_idx, weights))

    chunk = DEFAULT_CHUNK if chunk_size is None else chunk_size
    if indices is not None:
        per_key = max(n_heads, idx_heads) + dim + idx_dim
        plan = _plan_for(n_q, n_k, indices, None, None, chunk, per_key)
        key_start = query_end = None
        has_keys = (indices >= 0).any(dim=-1)
    else:
        win = windows(key_start, query_end, n_q, n_k)
        plan = _dense_plan(win, n_q, chunk, max(n_heads, idx_heads) + 2)
        has_keys = (win.n_valid > 0).to(dev)
    counted, counted_host, n_tokens, kl_sum, d_qi, d_ki, d_w = kl_accumulators(
        q_idx, k_idx, weights, has_keys, token_mask, need_grad, cdt)

    with torch.no_grad():
        for c0, c1, lo, hi in plan:
            if not bool(counted_host[c0:c1].any()):
                continue
            keys = _KeySet(c0, c1, lo, hi, indices, key_start, query_end)
            rows = counted[c0:c1]
            allowed = keys.mask & rows.unsqueeze(-1)  # [C, n]

            # target: main attention probabilities summed over heads, L1-normalised
            kc = keys.take(kv, cdt)
            s = (q[c0:c1].to(cdt) @ kc.mT) * attn_softmax_scale
            p, _ = _masked_softmax(s, keys.mask.unsqueeze(1))
            del s, kc
            head_sum = p.sum(dim=1)  # [C, n]
            del p
            if head_sum_reduce is not None:
                head_sum = head_sum_reduce(head_sum)
            total = head_sum.sum(dim=-1, keepdim=True)
            target = head_sum / torch.where(total > 0, total, torch.ones_like(total))
            target = target.masked_fill(~allowed, 0.0)

            # indexer distribution over the same key set
            qi = q_idx[c0:c1].to(cdt)
            kic = keys.take(k_idx, cdt)
            w = weights[c0:c1].to(cdt)
            a, z = _index_logits(qi, kic, w, idx_softmax_scale)
            z = z.masked_fill(~keys.mask, _NEG_INF)
            log_ind = torch.log_softmax(z, dim=-1)
            log_ind = log_ind.masked_fill(~allowed, 0.0)  # also clears NaN rows without keys
            pos = target > 0
            safe_t = torch.where(pos, target, torch.ones_like(target))
            kl_sum += torch.where(pos, target * (torch.log(safe_t) - log_ind), torch.zeros_like(target)).sum()

            if need_grad:
                g = torch.where(allowed, torch.exp(log_ind) - target, torch.zeros_like(target))  # dKL/dz [C, n]
                d_w[c0:c1] = (torch.relu(a) @ g.unsqueeze(-1)).squeeze(-1)
                da = (g.unsqueeze(1) * w.unsqueeze(-1)) * (a > 0) * idx_softmax_scale  # [C, Hi, n]
                del a
                d_qi[c0:c1] = da @ kic
                keys.add_into(d_ki, keys.outer(da, qi))

    kl_sum = kl_sum if cdt == torch.float64 else kl_sum.float()
    if need_grad:
        kl_sum = _IndexerKLFunction.apply(
            q_idx, k_idx, weights, kl_sum,
            d_qi.to(q_idx.dtype) if q_idx.requires_grad else None,
            d_ki.to(k_idx.dtype) if k_idx.requires_grad else None,
            d_w.to(weights.dtype) if weights.requires_grad else None,
        )
    return kl_sum, n_tokens


# ----------------------------------------------------------------------------------------------------------------------
# 4. naive oracles for tests (full [T, Tk] / [T, H, Tk] matrices; obviously correct, not memory-lean)
# ----------------------------------------------------------------------------------------------------------------------


def window_mask_naive(key_start: Tensor, query_end: Tensor, n_keys: int) -> Tensor:
    """[T, Tk] bool: key_start[t] <= j <= query_end[t]."""
    j = torch.arange(n_keys, device=key_start.device)
    return (j[None, :] >= key_start[:, None]) & (j[None, :] <= query_end[:, None])


def indices_mask_naive(indices: Tensor, n_keys: int) -> Tensor:
    """[T, Tk] bool: key j is among indices[t] (-1 ignored)."""
    mask = torch.zeros(indices.shape[0], n_keys + 1, dtype=torch.bool, device=indices.device)
    idx = indices.long().clone()
    idx[idx < 0] = n_keys  # dump column
    mask.scatter_(1, idx, True)
    return mask[:, :n_keys]


def indexer_scores_naive(q_idx: Tensor, k_idx: Tensor, weights: Tensor, softmax_scale: float) -> Tensor:
    """[T, Tk] index scores sum_h w[t, h] relu(scale * q_idx[t, h] . k_idx[j]) (autograd-capable)."""
    cdt = _compute_dtype(q_idx, k_idx, weights)
    dots = torch.einsum("thd,jd->thj", q_idx.to(cdt), k_idx.to(cdt)) * softmax_scale
    return torch.einsum("th,thj->tj", weights.to(cdt), torch.relu(dots))


@torch.no_grad()
def indexer_topk_naive(q_idx, k_idx, weights, topk, key_start, query_end, softmax_scale) -> Tensor:
    scores = indexer_scores_naive(q_idx, k_idx, weights, softmax_scale).cpu()
    out = torch.full((q_idx.shape[0], topk), -1, dtype=TOPK_DTYPE)
    for t in range(q_idx.shape[0]):
        lo, hi = int(key_start[t]), int(query_end[t])
        cand = sorted(range(lo, hi + 1), key=lambda j: (-float(scores[t, j]), j))[:topk]
        out[t, :len(cand)] = torch.tensor(cand, dtype=TOPK_DTYPE)
    return out.to(q_idx.device)


def _naive_softmax_rows(s: Tensor, mask: Tensor) -> Tuple[Tensor, Tensor]:
    s = s.masked_fill(~mask, _NEG_INF)
    m = s.detach().amax(dim=-1, keepdim=True)
    m = m.masked_fill(m == _NEG_INF, 0.0)
    e = torch.exp(s - m)
    den = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(den > 0, den, torch.ones_like(den))
    lse = (m + torch.log(den)).squeeze(-1)
    return p, lse


def sparse_mla_naive(q, kv, indices, softmax_scale, d_v, key_start=None, query_end=None):
    """Full-matrix MLA oracle: [T, H, Tk] scores, masked by indices (or the windows); autograd-capable."""
    cdt = _compute_dtype(q, kv)
    n_k = kv.shape[0]
    if indices is not None:
        mask = indices_mask_naive(indices, n_k)
    else:
        mask = window_mask_naive(key_start, query_end, n_k)
    kvc = kv.to(cdt)
    s = torch.einsum("thd,jd->thj", q.to(cdt), kvc) * softmax_scale
    p, lse = _naive_softmax_rows(s, mask[:, None, :])
    out = torch.einsum("thj,jd->thd", p, kvc[:, :d_v])
    return out.to(q.dtype), lse


def indexer_kl_loss_naive(
    q_idx, k_idx, weights, idx_softmax_scale, q, kv, attn_softmax_scale, key_start, query_end,
    indices=None, token_mask=None, head_sum_reduce=None,
):
    """Full-matrix oracle of indexer_kl_loss: (kl_sum, n_tokens), autograd through the index scores only."""
    cdt = _compute_dtype(q_idx, k_idx, weights, q, kv)
    n_k = kv.shape[0]
    mask = indices_mask_naive(indices, n_k) if indices is not None else window_mask_naive(key_start, query_end, n_k)
    rows = mask.any(dim=-1)
    if token_mask is not None:
        rows = rows & token_mask.bool()
    with torch.no_grad():
        s = torch.einsum("thd,jd->thj", q.to(cdt), kv.to(cdt)) * attn_softmax_scale
        p, _ = _naive_softmax_rows(s, mask[:, None, :])
        head_sum = p.sum(dim=1)
        if head_sum_reduce is not None:
            head_sum = head_sum_reduce(head_sum)
        target = head_sum / head_sum.sum(dim=-1, keepdim=True)
        target = target[rows]
    m = mask[rows]
    z = indexer_scores_naive(q_idx, k_idx, weights, idx_softmax_scale)[rows]
    log_ind = torch.log_softmax(z.masked_fill(~m, _NEG_INF), dim=-1)
    kl = torch.where(target > 0, target * (torch.log(target.clamp_min(1e-300)) - log_ind), torch.zeros_like(target))
    return kl.sum(), int(rows.sum())
