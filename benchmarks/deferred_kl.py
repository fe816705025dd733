"""Per-layer cost of the sparse-stage indexer KL on one GPU: forward-time (today's ``--attn triton`` path before the
deferred KL) against deferred (``ops/deferred_kl.py``: head sums from the sparse-MLA backward), and the backward's
Delta = rowsum(dO * O) as the earlier fp32 torch expression against the Triton kernel.

    python benchmarks/deferred_kl.py [--seqs 4096] [--reps 20] [--json deferred_kl.json]

Shapes: GLM-5's (h 64, d_qk 576 = 512 latent + 64 rope, d_v 512, top-k 2048, indexer 32 heads x 128), bf16, batch 1
causal, random distinct keys of each window (-1 padded for early tokens).  Timed per layer (CUDA events, median of
--reps after 3 warm-ups): sparse forward + backward + the KL work.  "forward-time": sparse_mla_fwd,
head_summed_probs (with the forward's lse), the fused KL kernel with gradients, sparse_mla_bwd.  "deferred":
sparse_mla_fwd, sparse_mla_bwd writing the head sums, the fused KL kernel.  Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cuda_timing import median_ms  # noqa: E402 (benchmarks/, the script's folder)

H, DQK, DV, TOPK, HI, DI = 64, 576, 512, 2048, 32, 128


def causal_indices(s: int, topk: int, gen) -> torch.Tensor:
    j = torch.arange(s, device="cuda")
    r = torch.rand(s, s, device="cuda", generator=gen)
    r = torch.where(j[None, :] <= j[:, None], r, -1.0)
    val, idx = torch.topk(r, topk, dim=-1)
    return torch.where(val >= 0, idx, -1).int().contiguous()


def timed(fn, reps: int) -> float:
    return median_ms(fn, reps)


def run(s: int, reps: int) -> dict:
    from megatron_glm5.ops import triton_kl, triton_sparse_mla as tsm

    gen = torch.Generator(device="cuda").manual_seed(0)
    idx = causal_indices(s, TOPK, gen)
    q = torch.randn(s, H, DQK, device="cuda", generator=gen).bfloat16()
    kv = torch.randn(s, DQK, device="cuda", generator=gen).bfloat16()
    d_out = torch.randn(s, H, DV, device="cuda", generator=gen).bfloat16()
    qi = torch.randn(s, HI, DI, device="cuda", generator=gen).bfloat16()
    ki = torch.randn(s, DI, device="cuda", generator=gen).bfloat16()
    w = torch.randn(s, HI, device="cuda", generator=gen) * HI ** -0.5
    scale, iscale = DQK ** -0.5, DI ** -0.5
    out, lse = tsm.sparse_mla_fwd(q, kv, idx, scale, DV)

    def kl(head_sums):
        return triton_kl.indexer_kl_grads(qi, ki, w, idx, head_sums, iscale)

    def forward_time():
        o, l = tsm.sparse_mla_fwd(q, kv, idx, scale, DV)
        kl(triton_kl.head_summed_probs(q, kv, idx, scale, DV, attn_lse=l))
        tsm.sparse_mla_bwd(q, kv, idx, o, l, d_out, None, scale, DV)

    def deferred():
        o, l = tsm.sparse_mla_fwd(q, kv, idx, scale, DV)
        hs = torch.empty(idx.shape, dtype=torch.float32, device="cuda")
        tsm.sparse_mla_bwd(q, kv, idx, o, l, d_out, None, scale, DV, head_sums=hs)
        kl(hs)

    hs = torch.empty(idx.shape, dtype=torch.float32, device="cuda")
    rows = {
        "sparse fwd": timed(lambda: tsm.sparse_mla_fwd(q, kv, idx, scale, DV), reps),
        "sparse bwd": timed(lambda: tsm.sparse_mla_bwd(q, kv, idx, out, lse, d_out, None, scale, DV), reps),
        "sparse bwd + head sums": timed(
            lambda: tsm.sparse_mla_bwd(q, kv, idx, out, lse, d_out, None, scale, DV, head_sums=hs), reps),
        "head_summed_probs (lse given)": timed(lambda: triton_kl.head_summed_probs(q, kv, idx, scale, DV,
                                                                                  attn_lse=lse), reps),
        "indexer KL kernel (grads)": timed(lambda: kl(hs), reps),
        "delta: torch fp32 expression": timed(lambda: (d_out.float() * out.float()).sum(-1), reps),
        "delta: Triton kernel": timed(lambda: tsm.bwd_delta(out, d_out, None), reps),
        "layer, forward-time KL": timed(forward_time, reps),
        "layer, deferred KL": timed(deferred, reps),
    }
    ref = triton_kl.head_summed_probs(q, kv, idx, scale, DV, attn_lse=lse)
    tsm.sparse_mla_bwd(q, kv, idx, out, lse, d_out, None, scale, DV, head_sums=hs)
    d_ref = (d_out.float() * out.float()).sum(-1)
    return dict(seq=s, ms={k: round(v, 3) for k, v in rows.items()},
                head_sums_max_abs_diff=float((hs - ref).abs().max()),
                delta_max_rel_diff=float(((tsm.bwd_delta(out, d_out, None) - d_ref).abs().max()
                                          / d_ref.abs().max().clamp_min(1e-30))))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[4096])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    res = dict(device=torch.cuda.get_device_name(), command=" ".join(["python3"] + sys.argv),
               torch=torch.__version__, results=[run(s, a.reps) for s in a.seqs])
    text = json.dumps(res, indent=1)
    print(text)
    if a.json:
        Path(a.json).write_text(text)


if __name__ == "__main__":
    main()
