"""``--attn cudnn``: cuDNN frontend's DeepSeek-Sparse-Attention (DSA) ops, FlashMLA (or Triton) forward.

Contract read from the nvidia-cudnn-frontend 1.32.0 wheel (cp312 manylinux_2_28_x86_64, from PyPI), package
``cudnn.deepseek_sparse_attention``: ``__init__.py`` (the ``cudnn.DSA`` namespace), ``sparse_attention_backward/
api.py`` + ``_interface_sm90.py``, ``indexer_forward/api.py`` + ``_interface_sm90.py`` + ``indexer_fwd_sm90.py``,
``indexer_top_k/api.py`` and ``training.py``; cross-checked with the documentation page "DeepSeek Sparse Attention
(DSA)" (docs.nvidia.com/cudnn, fe-oss-apis/dsa).  Install: ``pip install 'nvidia-cudnn-frontend[cutedsl]'`` (pulls
nvidia-cutlass-dsl, cuda-python, apache-tvm-ffi).  The API is marked experimental upstream.

    DSA.sparse_attention_backward_wrapper(q, kv, out, dout, lse, attn_sink, topk_idxs, softmax_scale=None,
                                          topk_length=None, ...) -> {"dq", "dkv", "d_sink"}
        q [S_q, H, D] bf16/fp16, kv [S_kv, D] (K = V, MQA), out / dout [S_q, H, D_v] (q's dtype),
        lse [S_q, H] fp32 "KV-only" natural-log LSE of the scaled scores as FlashMLA writes it (+inf: no keys),
        attn_sink [H] fp32 (-inf = no sink), topk_idxs [S_q, K] int32 global rows (outside [0, S_kv): ignored);
        D in {512, 576}, D_v = 512 for D = 576 else D, H > 1, contiguous; SM90 or SM100.  No lse gradient input.
    DSA.indexer_forward_wrapper(q [B, S_q, H, 128] bf16, k [B, S_k, 1, 128] bf16, w [B, S_q, H] bf16/fp32,
                                ratio=4, sm_scale=1.0, q_causal_offsets=None, ...) -> {"scores": [B, S_q, S_k] fp32}
        scores = sm_scale * sum_h relu(q_h . k) * w_h; column c of query row r is masked (-inf) unless
        c < (q_causal_offsets[b] + r + 1) // ratio.  SM90: H in {16, 32, 64}.
    DSA.indexer_top_k_wrapper(values [n_rows, n_cols], seq_lens [n_rows] int32, top_k <= 2048, next_n=1,
                              deterministic=False, ...) -> {"indices": local columns int32, "values"}
        deterministic=True: ties go to the smaller column and the selected columns come back in ascending order;
        short rows padded with -1 / -inf.

What each op runs here:
Every op or shape the cuDNN kernels do not cover goes to ``self.fallback``, the Triton backend, with a warning
logged once per reason.

  * indexer_topk: the cuDNN indexer forward + top-k, in query chunks.  For a chunk we pass the key rows
    [lo, hi) it can see, set q_causal_offsets = hi - lo - 1 (so the kernel's causal mask keeps every passed
    column), mask the exact windows key_start <= j <= query_end ourselves (-inf), run the deterministic top-k and
    re-sort the chosen keys by descending score (stable, so ties keep the smaller row) -- the order and -1 padding
    of ``reference.indexer_topk``.  Shapes outside the documented limits (index head dim != 128, heads not in
    {16, 32, 64}, topk > 2048) use the Triton backend's kernel.
  * sparse_mla: forward by FlashMLA's ``flash_mla_sparse_fwd`` when flash_mla is installed and the shape fits it
    (see flashmla_sparse_mla), else our Triton forward; backward by ``sparse_attention_backward_wrapper`` (lse -inf
    -> +inf, attn_sink = -inf, indices outside [0, Tk) -> -1 and top-k padded with -1 to a multiple of 128, the
    launch envelope the upstream training adapter uses).  When the lse output itself receives a gradient (the
    cuDNN kernel has no d_lse input) the backward uses our Triton kernel for that call.  Shapes outside the limits
    above use the Triton backend.
  * indexer_kl_loss: the Triton backend's.  The cuDNN score-recompute + indexer-backward kernels return gradients
    but not the loss value, normalise the head-summed attention inside the kernel (no hook for our TP
    head_sum_reduce all-reduce) and have no token mask, so our op cannot be expressed with them.

Verified: on CPU against fake ``cudnn`` / ``flash_mla`` modules implementing the contracts above in plain torch
(tests/test_ops_external_backends.py), and on an H200 against the real library (nvidia-cudnn-frontend 1.32.0,
nvidia-cutlass-dsl 4.8.1; the GPU tests there: 4 passed on 2026-11-30).
"""

from __future__ import annotations

import importlib
import logging
from typing import Optional

import torch

from . import flashmla_sparse_mla, reference
from .base import LibraryBackend, pad_topk, sparse_mla_autograd, triton_backward_reason, warn_once
from .triton_backend import TritonBackend

__all__ = ["CudnnBackend", "CUDNN_INSTALL"]

CUDNN_INSTALL = "pip install 'megatron-glm5[cudnn]' (package nvidia-cudnn-frontend[cutedsl])"
INDEXER_HEAD_DIM = 128
INDEXER_HEADS = (16, 32, 64)
TOPK_MAX = 2048
BWD_DQK = (512, 576)
SCORE_BUDGET = 1 << 26  # fp32 elements of one chunk's [rows, keys] score block (256 MiB)


def import_dsa():
    """cudnn.DSA (ImportError when cudnn or its CuTe-DSL dependencies are missing)."""
    cudnn = importlib.import_module("cudnn")
    dsa = getattr(cudnn, "DSA", None)
    if dsa is None:
        raise ImportError("this cudnn frontend has no DSA namespace (needs nvidia-cudnn-frontend >= 1.2x)")
    return dsa


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


logger = logging.getLogger("megatron_glm5.ops")
_SEEN_SHAPES: set = set()


def note_new_shape(op: str, shape: tuple) -> bool:
    """Logs, once per (op, shape), that cuDNN JIT-compiles its kernels for a new problem shape (the first training
    iterations of --attn cudnn take seconds, not milliseconds, for this reason); True the first time."""
    key = (op, tuple(shape))
    if key in _SEEN_SHAPES:
        return False
    _SEEN_SHAPES.add(key)
    logger.info("cuDNN DSA %s: first call with shape %s: cuDNN JIT-compiles kernels for it (once per shape; "
                "seconds)", op, tuple(shape))
    return True


def _normalize_indices(indices: torch.Tensor, n_keys: int) -> torch.Tensor:
    """int32, every slot outside [0, n_keys) set to -1 (the cuDNN backward only skips negative entries safely)."""
    idx = indices.to(torch.int32)
    return torch.where((idx >= 0) & (idx < n_keys), idx, torch.full_like(idx, -1)).contiguous()


def cudnn_sparse_backward(q, kv, indices, out, lse, d_out, softmax_scale):
    """(dq, dkv) from DSA.sparse_attention_backward_wrapper; lse in our convention (-inf = no keys)."""
    dsa = import_dsa()
    lse_c = torch.where(lse == float("-inf"), torch.full_like(lse, float("inf")), lse).float().contiguous()
    sink = torch.full((q.shape[1],), float("-inf"), dtype=torch.float32, device=q.device)
    note_new_shape("sparse backward", (*q.shape, kv.shape[0], indices.shape[1]))
    res = dsa.sparse_attention_backward_wrapper(
        q.contiguous(), kv.contiguous(), out.contiguous(), d_out.to(q.dtype).contiguous(), lse_c, sink,
        pad_topk(indices), softmax_scale=float(softmax_scale))
    return res["dq"], res["dkv"]


def _cudnn_or_triton_backward(q, kv, idx, out, lse, d_out, d_lse, softmax_scale, d_v, deterministic):
    """The cuDNN sparse backward; the Triton one when lse receives a gradient (cuDNN has no input for it)."""
    from . import triton_sparse_mla

    if d_lse is not None:
        warn_once("cudnn", "the cuDNN sparse backward has no lse-gradient input")
        return triton_sparse_mla.sparse_mla_bwd(q, kv, idx, out, lse, d_out, d_lse, softmax_scale, d_v,
                                                deterministic)
    return cudnn_sparse_backward(q, kv, idx, out, lse, d_out, softmax_scale)


class CudnnBackend(LibraryBackend):
    """cuDNN DSA indexer top-k and sparse backward, FlashMLA / Triton forward; the KL loss and every shape the
    cuDNN kernels do not take are ``self.fallback``'s, the Triton backend (see module doc)."""

    name = "cudnn"
    implemented = True

    def __init__(self, deterministic: Optional[bool] = None):
        self.deterministic = deterministic
        self.fallback = TritonBackend(deterministic)
        self._dsa_error: Optional[str] = None
        self._probed = False
        self._has_flash_mla: Optional[bool] = None

    def _probe(self) -> Optional[str]:
        """None when cudnn.DSA and its ops import, else the reason."""
        if not self._probed:
            self._probed = True
            try:
                cudnn = importlib.import_module("cudnn")
            except Exception as e:  # ImportError, or a broken install failing at import time
                self._dsa_error = f"--attn cudnn needs the cudnn frontend package: {CUDNN_INSTALL} ({_first_line(e)})"
                return self._dsa_error
            try:
                dsa = import_dsa()
                for op in ("sparse_attention_backward_wrapper", "indexer_forward_wrapper", "indexer_top_k_wrapper"):
                    getattr(dsa, op)  # loads the CuTe-DSL module (needs nvidia-cutlass-dsl, cuda-python)
            except Exception as e:
                version = getattr(cudnn, "__version__", "?")
                self._dsa_error = (f"--attn cudnn: cudnn frontend {version} cannot load its DSA ops ({_first_line(e)}); "
                                   f"{CUDNN_INSTALL}")
        return self._dsa_error

    def has_dsa(self) -> bool:
        return self._probe() is None

    def has_flash_mla(self) -> bool:
        if self._has_flash_mla is None:
            self._has_flash_mla = flashmla_sparse_mla.probe_flash_mla()
        return self._has_flash_mla

    def unavailable_reason(self) -> Optional[str]:
        return self._probe() or self.fallback.triton_missing(self.name, "(forward without FlashMLA, KL loss)")

    # -- indexer ---------------------------------------------------------------------------------------------------

    def indexer_topk(self, q_idx, k_idx, weights, topk, key_start, query_end, softmax_scale, chunk_size=1024):
        n_q, n_heads, d_i = q_idx.shape
        why = None
        if d_i != INDEXER_HEAD_DIM or n_heads not in INDEXER_HEADS:
            why = f"the cuDNN indexer needs head dim {INDEXER_HEAD_DIM} and {INDEXER_HEADS} heads, got {d_i} / {n_heads}"
        elif not 0 < int(topk) <= TOPK_MAX:
            why = f"the cuDNN top-k needs 0 < topk <= {TOPK_MAX}, got {topk}"
        elif not float(softmax_scale) > 0:
            why = f"the cuDNN indexer folds softmax_scale out of the ReLU, which needs it > 0 (got {softmax_scale})"
        if why is not None:
            warn_once(self.name, why)
            return self.fallback.indexer_topk(q_idx, k_idx, weights, topk, key_start, query_end, softmax_scale,
                                              chunk_size)
        return self._cudnn_topk(q_idx, k_idx, weights, int(topk), key_start, query_end, float(softmax_scale),
                                int(chunk_size or 1024))

    def _cudnn_topk(self, q_idx, k_idx, weights, topk, key_start, query_end, softmax_scale, chunk_size):
        dsa = import_dsa()
        dev = q_idx.device
        n_q = q_idx.shape[0]
        out = torch.full((n_q, topk), -1, dtype=reference.TOPK_DTYPE, device=dev)
        ks = key_start.reshape(-1).to(dev, torch.int64)
        qe = query_end.reshape(-1).to(dev, torch.int64)
        # the step's one host copy of the windows (shared by every layer): plans the chunks without a sync per layer
        win = reference.windows(key_start, query_end, n_q, k_idx.shape[0])
        c0 = 0
        while c0 < n_q:
            c1 = min(n_q, c0 + chunk_size)
            lo, hi = win.span(c0, c1)
            hi += 1
            while c1 - c0 > 1 and (c1 - c0) * max(1, hi - lo) > SCORE_BUDGET:
                c1 = c0 + (c1 - c0) // 2
                lo, hi = win.span(c0, c1)
                hi += 1
            if hi > lo:
                self._topk_chunk(dsa, q_idx, k_idx, weights, topk, ks, qe, softmax_scale, c0, c1, lo, hi, out)
            c0 = c1
        return out

    @staticmethod
    def _topk_chunk(dsa, q_idx, k_idx, weights, topk, ks, qe, softmax_scale, c0, c1, lo, hi, out):
        n_cols, rows = hi - lo, c1 - c0
        dev = q_idx.device
        q = q_idx[c0:c1].to(torch.bfloat16).unsqueeze(0).contiguous()  # [B = 1, S_q, H, 128]
        k = k_idx[lo:hi].to(torch.bfloat16).reshape(1, n_cols, 1, -1).contiguous()  # [1, S_k, H_kv = 1, 128]
        w = weights[c0:c1].float().unsqueeze(0).contiguous()  # [1, S_q, H]
        # q[0] of the chunk placed at global position n_cols - 1: the kernel's causal mask keeps every column
        offsets = torch.full((1,), n_cols - 1, dtype=torch.int32, device=dev)
        scores = dsa.indexer_forward_wrapper(q, k, w, ratio=1, sm_scale=softmax_scale,
                                             q_causal_offsets=offsets)["scores"][0]
        j = torch.arange(lo, hi, device=dev)
        inside = (j[None, :] >= ks[c0:c1, None]) & (j[None, :] <= qe[c0:c1, None])
        scores = scores.masked_fill(~inside, float("-inf")).contiguous()
        k_sel = min(topk, n_cols)
        seq_lens = torch.full((rows,), n_cols, dtype=torch.int32, device=dev)
        note_new_shape("indexer top-k", (rows, n_cols, q.shape[2], k_sel))
        res = dsa.indexer_top_k_wrapper(scores, seq_lens, top_k=k_sel, deterministic=True)
        cols, vals = res["indices"].long(), res["values"].float()
        order = torch.sort(-vals, dim=1, stable=True).indices  # descending score; ties keep ascending columns
        cols = cols.gather(1, order)
        n_valid = inside.sum(dim=1, keepdim=True)
        slot = torch.arange(k_sel, device=dev)[None, :]
        out[c0:c1, :k_sel] = torch.where(slot < n_valid, cols + lo, torch.full_like(cols, -1)).to(reference.TOPK_DTYPE)

    # -- sparse MLA ------------------------------------------------------------------------------------------------

    def sparse_mla(self, q, kv, indices, softmax_scale, d_v, key_start=None, query_end=None, chunk_size=None):
        if indices is not None:
            why = self._sparse_unsupported_reason(q, kv, d_v)
            if why is None:
                from . import triton_sparse_mla

                use_flashmla = (self.has_flash_mla()
                                and flashmla_sparse_mla.flashmla_unsupported_reason(q, kv, d_v) is None)
                forward = (flashmla_sparse_mla.flash_mla_sparse_forward if use_flashmla
                           else triton_sparse_mla.sparse_mla_fwd)
                return sparse_mla_autograd(q, kv, _normalize_indices(indices, kv.shape[0]), softmax_scale, d_v,
                                           self.deterministic, forward, _cudnn_or_triton_backward)
            warn_once(self.name, why)
        return self.fallback.sparse_mla(q, kv, indices, softmax_scale, d_v, key_start, query_end, chunk_size)

    @staticmethod
    def _sparse_unsupported_reason(q, kv, d_v) -> Optional[str]:
        if q.dim() != 3 or kv.dim() != 2:
            return f"expected q [T, h, D] and kv [Tk, D], got {tuple(q.shape)} and {tuple(kv.shape)}"
        h, d = q.shape[1], q.shape[2]
        if q.dtype not in (torch.bfloat16, torch.float16) or kv.dtype != q.dtype:
            return f"the cuDNN sparse backward needs bf16/fp16 q and kv of one dtype, got {q.dtype} / {kv.dtype}"
        if d not in BWD_DQK or d_v != (512 if d == 576 else d) or h < 2:
            return f"the cuDNN sparse backward needs D in {BWD_DQK}, d_v 512 (D 576) and > 1 head, got {d} / {d_v} / {h}"
        # our Triton kernels (forward without FlashMLA, backward with an lse gradient) need power-of-two parts
        return triton_backward_reason(q, d_v)
