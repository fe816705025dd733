"""The TileLang helper library of ``--attn tilelang`` (probe, compile cache, shared macros, lowering without a GPU)
and our TileLang sparse MLA forward (out, lse); the backward is ours too (tilelang_sparse_mla_bwd).

Semantics are those of ``triton_sparse_mla.sparse_mla_fwd``: q [T, h, D] with D = d_v + d_rope (GLM-5: 512 latent +
64 rope; the latent part of kv is also V), kv [Tk, D] shared by all heads, indices [T, K] int (-1 or >= Tk: unused).
Returns out [T, h, d_v] in q's dtype and lse [T, h] fp32, the natural log of the sum of exp of the *scaled* scores;
a row without any valid key gets out = 0 and lse = -inf (what ``triton_sparse_mla.sparse_mla_bwd`` expects).

The kernel (``build_sparse_fwd``): one thread block per (query token, group of HEAD_BLOCK = 64 heads).  The 64 heads
are the M dimension of both matrix products; q's latent and rope parts stay in shared memory for the whole loop.  The
K selected kv rows are gathered block_n at a time into shared memory (an unused slot reads a clamped row and its
score is masked to -inf), scores = q_lat k_lat^T + q_rope k_rope^T in fp32, online softmax in base 2 (exp2, the
scale folded with log2 e), p rounded to bf16 for the P V product, fp32 accumulation.  The running max starts at a
finite floor (-1e30) instead of -inf, so a block of masked slots gives p = 0 without an inf - inf; rows whose sum
stays 0 are the "no keys" rows.  Head counts that are not a multiple of 64 are zero-padded to one (padded rows are
dropped).  K is padded with -1 to a multiple of block_n (``base.pad_topk``).  The token count and Tk
are dynamic in the compiled kernel; one kernel is compiled lazily per (heads, d_v, d_rope, padded K, scale,
config) and cached.
Three configurations here: FWD_CONFIG (this function's default; a plain loop, 64 rows per step), PIPELINED_CONFIG
(T.Pipelined, two stages: the cp.async gather of the next 32 rows overlaps this block's math) and PIPELINED64_CONFIG
(the same with 64 rows).  ptxas for sm_90a: 215 registers, no spills (plain); 255 registers, 4 bytes spilled
(pipelined).  On the H200 at S 4096: plain 242, pipelined64 263 TFLOP/s (docs/performance.md, session 9).  The
warp-specialised kernel (producer / two consumers, FlashMLA's schedule: 542-559 at S 4096) is ``tilelang_sparse_mla_ws.WS_CONFIG``
and the ``--attn tilelang`` forward (``tilelang_backend.forward_kernel``): a config naming its own ``builder`` is
passed through whole (its ``topk_multiple`` sets the top-k padding, ``fast_math`` TileLang's fast-math pass).

Backward: our TileLang kernel, ``tilelang_sparse_mla_bwd.tilelang_sparse_bwd`` (see that module; the backend runs
Triton's backward unless GLM5_TILELANG_BWD=tilelang), through the backends' autograd Function
(``base.SparseMLAFunction``); in deterministic mode the backward is ``triton_sparse_mla.sparse_mla_bwd`` (logged
once).  The backend itself is ``tilelang_backend``.
``lower_artifact`` / ``lower_to_cuda`` / ``dynamic_shared_bytes`` lower any of the kernels without a GPU.

Verified: on a CPU-only machine with tilelang 0.1.15, both configurations lower to CUDA source for sm_90a and that
source compiles with nvcc 13.0 to a cubin (``lower_to_cuda``; tests/test_ops_tilelang.py).  On the H200
(2026-11-30) the GPU tests in tests/test_ops_tilelang.py pass against the fp32 torch reference.
"""

# no ``from __future__ import annotations``: TileLang evaluates the kernel's annotations (closure sizes) eagerly
import importlib
import math
from typing import Dict, Optional, Tuple

import torch

from .base import pad_topk

__all__ = ["build_sparse_fwd", "dynamic_shared_bytes", "lower_artifact", "lower_to_cuda",
           "tilelang_sparse_fwd", "tilelang_unsupported_reason", "TILELANG_INSTALL", "FWD_CONFIG", "PIPELINED_CONFIG",
           "PIPELINED64_CONFIG"]

TILELANG_INSTALL = "pip install 'megatron-glm5[tilelang]'"
LOG2E = 1.4426950408889634
LN2 = math.log(2.0)
HEAD_BLOCK = 64  # heads per thread block: the M dimension of the wgmma tiles (one warpgroup's M is 64)
M_FLOOR = -1.0e30  # starting running max (log2 units): finite, so fully masked blocks never compute inf - inf
#: kv rows gathered per step, threads per block (two warpgroups), software-pipeline stages of the gather loop
#: (0: a plain loop, gather then compute; 2: cp.async gather of the next block overlapping this block's math)
FWD_CONFIG = dict(block_n=64, threads=256, num_stages=0)
PIPELINED_CONFIG = dict(block_n=32, threads=256, num_stages=2)
#: TileLang's own example kernel's shape (64 rows, two stages): 231,424 bytes of shared memory (226 KiB, the H200
#: allows 227 KiB), 255 registers, 12 bytes spilled for sm_90a; 263 TFLOP/s at S 4096 on the H200
PIPELINED64_CONFIG = dict(block_n=64, threads=256, num_stages=2)

_KERNELS: Dict[tuple, object] = {}


def import_tilelang():
    """The tilelang module, or ImportError."""
    return importlib.import_module("tilelang")


def probe_tilelang() -> bool:
    try:
        import_tilelang()
        return True
    except Exception:  # ImportError, or a broken install failing at import time
        return False


def query_loader(d_v: int, d_qk: int):
    """T.macro: the 64 heads h0.. of query tok, latent and rope parts, into shared memory (every kernel of ours that
    works per (query, head block) starts with it)."""
    import tilelang.language as T

    @T.macro
    def load_query(Q, tok, h0, q_lat, q_rope):
        T.copy(Q[tok, h0:h0 + HEAD_BLOCK, 0:d_v], q_lat)
        T.copy(Q[tok, h0:h0 + HEAD_BLOCK, d_v:d_qk], q_rope)

    return load_query


def selected_scores(block_n: int, d_v: int, d_rope: int):
    """T.macro: gather the kv rows selected by slots kb * block_n .. of query tok into shared memory (an unused slot,
    -1 or >= n_kv, reads a clamped row: the caller masks its score) and s = q_lat k_lat^T + q_rope k_rope^T (fp32,
    unscaled) -- the start of every step of our forward, backward and KL-target kernels."""
    import tilelang.language as T

    @T.macro
    def gather_and_score(KV, Idx, tok, kb, n_kv, q_lat, q_rope, k_lat, k_rope, s):
        for j, c in T.Parallel(block_n, d_v):
            k_lat[j, c] = KV[T.max(T.min(Idx[tok, kb * block_n + j], n_kv - 1), 0), c]
        for j, c in T.Parallel(block_n, d_rope):
            k_rope[j, c] = KV[T.max(T.min(Idx[tok, kb * block_n + j], n_kv - 1), 0), d_v + c]
        T.gemm(q_lat, k_lat, s, transpose_B=True, clear_accum=True)
        T.gemm(q_rope, k_rope, s, transpose_B=True)

    return gather_and_score


def compiled_kernel(builder, *sizes, pass_configs: Optional[dict] = None, **cfg):
    """``tilelang.compile(builder(*sizes, **cfg))``, once per (builder, sizes, configuration, TileLang pass configs)
    in this process (the kernels of the tilelang backend are compiled lazily, with token and key counts dynamic)."""
    key = (builder.__module__, builder.__name__, sizes, tuple(sorted(cfg.items())),
           tuple(sorted((pass_configs or {}).items())))
    kernel = _KERNELS.get(key)
    if kernel is None:
        import tilelang

        kernel = _KERNELS[key] = tilelang.compile(builder(*sizes, **cfg), target="cuda", pass_configs=pass_configs)
    return kernel


def with_sm_grid(cfg: dict, device) -> dict:
    """cfg with ``persistent`` True (a persistent kernel's grid: one thread block per SM) replaced by the SM count of
    ``device``'s GPU; other configurations as they are."""
    if cfg.get("persistent") is True:
        return dict(cfg, persistent=torch.cuda.get_device_properties(device).multi_processor_count)
    return cfg


def check_tiles(heads: int, topk: int, block_n: int) -> None:
    """The kernels tile heads by HEAD_BLOCK and the top-k slots by block_n (the wrappers pad both)."""
    if heads % HEAD_BLOCK or topk % block_n:
        raise ValueError(f"heads ({heads}) must be a multiple of {HEAD_BLOCK} and topk ({topk}) of {block_n}")


def build_sparse_fwd(heads: int, d_v: int, d_rope: int, topk: int, softmax_scale: float, block_n: int = 64,
                     threads: int = 256, num_stages: int = 0, dtype: str = "bfloat16"):
    """The TileLang prim_func of the sparse MLA forward for these static sizes (see the module docstring).

    Arguments of the kernel: Q [n_q, heads, d_v + d_rope], KV [n_kv, d_v + d_rope], Idx int32 [n_q, topk],
    Out [n_q, heads, d_v] (written), Lse fp32 [n_q, heads] (written); n_q and n_kv are dynamic.
    heads must be a multiple of HEAD_BLOCK and topk a multiple of block_n.
    """
    import tilelang.language as T

    check_tiles(heads, topk, block_n)
    d_qk = d_v + d_rope
    hb_n = heads // HEAD_BLOCK
    n_blocks = topk // block_n
    acc_t, idx_t = "float32", "int32"  # names, not string literals, in the annotations (linters read those)
    c_log2 = float(softmax_scale) * LOG2E
    n_q = T.dynamic("n_q")
    n_kv = T.dynamic("n_kv")
    load_query, gather_and_score = query_loader(d_v, d_qk), selected_scores(block_n, d_v, d_rope)

    @T.prim_func
    def sparse_mla_fwd_kernel(
        Q: T.Tensor((n_q, heads, d_qk), dtype),
        KV: T.Tensor((n_kv, d_qk), dtype),
        Idx: T.Tensor((n_q, topk), idx_t),
        Out: T.Tensor((n_q, heads, d_v), dtype),
        Lse: T.Tensor((n_q, heads), acc_t),
    ):
        with T.Kernel(n_q, hb_n, threads=threads) as (tok, hb):
            q_lat = T.alloc_shared((HEAD_BLOCK, d_v), dtype)
            q_rope = T.alloc_shared((HEAD_BLOCK, d_rope), dtype)
            k_lat = T.alloc_shared((block_n, d_v), dtype)
            k_rope = T.alloc_shared((block_n, d_rope), dtype)
            p_s = T.alloc_shared((HEAD_BLOCK, block_n), dtype)

            s = T.alloc_fragment((HEAD_BLOCK, block_n), acc_t)
            acc = T.alloc_fragment((HEAD_BLOCK, d_v), acc_t)
            m_run = T.alloc_fragment((HEAD_BLOCK,), acc_t)
            m_blk = T.alloc_fragment((HEAD_BLOCK,), acc_t)
            alpha = T.alloc_fragment((HEAD_BLOCK,), acc_t)
            l_run = T.alloc_fragment((HEAD_BLOCK,), acc_t)
            l_blk = T.alloc_fragment((HEAD_BLOCK,), acc_t)
            lse_f = T.alloc_fragment((HEAD_BLOCK,), acc_t)

            h0 = hb * HEAD_BLOCK
            load_query(Q, tok, h0, q_lat, q_rope)
            T.fill(acc, 0)
            T.fill(l_run, 0)
            T.fill(m_run, M_FLOOR)

            for kb in (T.Pipelined(n_blocks, num_stages=num_stages) if num_stages > 0 else T.serial(n_blocks)):
                gather_and_score(KV, Idx, tok, kb, n_kv, q_lat, q_rope, k_lat, k_rope, s)  # unused slots masked:
                for i, j in T.Parallel(HEAD_BLOCK, block_n):
                    sel = Idx[tok, kb * block_n + j]
                    s[i, j] = T.if_then_else((sel >= 0) and (sel < n_kv), s[i, j] * c_log2, -T.infinity(acc_t))

                T.reduce_max(s, m_blk, dim=1, clear=True)
                for i in T.Parallel(HEAD_BLOCK):
                    m_blk[i] = T.max(m_run[i], m_blk[i])
                    alpha[i] = T.exp2(m_run[i] - m_blk[i])
                    m_run[i] = m_blk[i]
                for i, j in T.Parallel(HEAD_BLOCK, block_n):
                    s[i, j] = T.exp2(s[i, j] - m_run[i])
                T.reduce_sum(s, l_blk, dim=1)
                for i in T.Parallel(HEAD_BLOCK):
                    l_run[i] = l_run[i] * alpha[i] + l_blk[i]
                for i, c in T.Parallel(HEAD_BLOCK, d_v):
                    acc[i, c] = acc[i, c] * alpha[i]
                T.copy(s, p_s)
                T.gemm(p_s, k_lat, acc)

            for i, c in T.Parallel(HEAD_BLOCK, d_v):
                acc[i, c] = T.if_then_else(l_run[i] > 0, acc[i, c] / l_run[i], 0)
            for i in T.Parallel(HEAD_BLOCK):
                lse_f[i] = T.if_then_else(l_run[i] > 0, (T.log2(l_run[i]) + m_run[i]) * LN2, -T.infinity(acc_t))
            T.copy(acc, Out[tok, h0:h0 + HEAD_BLOCK, :])
            T.copy(lse_f, Lse[tok, h0:h0 + HEAD_BLOCK])

    return sparse_mla_fwd_kernel


def cuda_target(arch: str = "sm_90a") -> dict:
    return {"kind": "cuda", "arch": arch}


def lower_artifact(prim_func, arch: str = "sm_90a"):
    """``tilelang.lower``'s result for ``arch`` (kernel_source, host / device IR) -- needs no GPU."""
    import tilelang
    from tilelang import tvm

    target = tvm.target.Target(cuda_target(arch))
    with target:
        return tilelang.lower(prim_func, target=target)


def lower_to_cuda(prim_func, arch: str = "sm_90a") -> str:
    """CUDA C++ source of a prim_func for ``arch`` -- needs no GPU (used to inspect / nvcc-check the kernel)."""
    return lower_artifact(prim_func, arch).kernel_source


def dynamic_shared_bytes(artifact) -> int:
    """Dynamic shared memory (bytes) a lowered artifact's kernels request at launch (the largest of them)."""
    sizes = [int(f.attrs["dyn_shared_memory_buf"]) for f in artifact.device_mod.functions.values()
             if f.attrs is not None and "dyn_shared_memory_buf" in f.attrs]
    return max(sizes, default=0)


def pop_pass_configs(cfg: dict) -> Optional[dict]:
    """The TileLang pass configs a kernel configuration asks for, its ``fast_math`` key popped: TileLang's fast
    exp2 / log2 pass; with a ``kv_hint`` (tilelang_sparse_mla_ws.KV_HINTS) the buffer-init check off -- the hinted
    kv copies are extern calls whose writes that check cannot see (it would warn that the kv buffers are read before
    anything writes them)."""
    configs = {}
    if cfg.pop("fast_math", False):
        configs["tl.enable_fast_math"] = True
    if cfg.get("kv_hint"):
        configs["tl.disable_buffer_init_check"] = True
    return configs or None


def _compiled(heads: int, d_v: int, d_rope: int, topk: int, softmax_scale: float, cfg: dict):
    cfg = dict(cfg)  # builder: the kernel's (default ours above)
    builder = cfg.pop("builder", build_sparse_fwd)
    passes = pop_pass_configs(cfg)
    return compiled_kernel(builder, heads, d_v, d_rope, topk, float(softmax_scale), pass_configs=passes, **cfg)


def tilelang_sparse_fwd(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, softmax_scale: float, d_v: int,
                        config: Optional[dict] = None, out: Optional[torch.Tensor] = None,
                        lse: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out [T, h, d_v] bf16, lse [T, h] fp32) from our TileLang kernel; same contract as
    ``triton_sparse_mla.sparse_mla_fwd`` (out / lse may be given: contiguous, written in full)."""
    # a config naming its own builder (tilelang_sparse_mla_ws.WS_CONFIG) is complete; others override FWD_CONFIG
    cfg = dict(config) if config and "builder" in config else dict(FWD_CONFIG, **(config or {}))
    topk_multiple = cfg.pop("topk_multiple", cfg.get("block_n"))
    n_q, h, d_qk = q.shape
    d_rope = d_qk - d_v
    h_pad = -(-h // HEAD_BLOCK) * HEAD_BLOCK
    q_k = q.contiguous()
    if h_pad != h:  # zero heads up to a whole head block; their rows are dropped below
        q_k = torch.nn.functional.pad(q_k, (0, 0, 0, h_pad - h))
    idx = pad_topk(indices, topk_multiple)
    out_k = out if out is not None and h_pad == h else torch.empty(n_q, h_pad, d_v, dtype=q.dtype, device=q.device)
    lse_k = lse if lse is not None and h_pad == h else torch.empty(n_q, h_pad, dtype=torch.float32, device=q.device)
    if n_q > 0:
        args = (q_k, kv.contiguous(), idx)
        if getattr(cfg.get("builder"), "takes_ends", False):  # the warp-specialised kernel: its loop bounds
            from .triton_sparse_mla import used_slot_ends  # each query's steps up to its last used slot

            args += (used_slot_ends(indices, kv.shape[0], topk_multiple) if cfg.get("bounded") else
                     torch.zeros(1, dtype=torch.int32, device=q.device),)
        cfg = with_sm_grid(cfg, q.device)
        kernel = _compiled(h_pad, d_v, d_rope, idx.shape[1], softmax_scale, cfg)
        kernel(*args, out_k, lse_k)
    if h_pad != h:
        out_k, lse_k = out_k[:, :h], lse_k[:, :h]
        if out is not None:
            out.copy_(out_k)
            out_k = out
        if lse is not None:
            lse.copy_(lse_k)
            lse_k = lse
    return out_k.contiguous(), lse_k.contiguous()


def tilelang_unsupported_reason(q: torch.Tensor, kv: torch.Tensor, d_v: int) -> Optional[str]:
    """Why our TileLang forward cannot take these inputs (None when it can)."""
    if q.dim() != 3 or kv.dim() != 2 or q.shape[-1] != kv.shape[-1]:
        return f"the TileLang forward needs q [T, h, D] and kv [Tk, D], got {tuple(q.shape)} and {tuple(kv.shape)}"
    if q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
        return f"the TileLang forward is bf16 only (got {q.dtype} / {kv.dtype})"
    d_rope = q.shape[-1] - d_v
    if d_v < 16 or d_v & (d_v - 1) or d_rope < 16 or d_rope & (d_rope - 1):
        return f"the TileLang forward needs power-of-two d_v and d_rope >= 16, got {d_v} / {d_rope}"
    return None
