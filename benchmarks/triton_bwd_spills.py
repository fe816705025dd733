"""Registers and spills of the Triton sparse-MLA backward's kernels (ops/triton_sparse_mla.py) per block
configuration, at GLM-5 shapes (h 64, d_qk 576, d_v 512, top-k 2048, bf16) on one GPU; prints JSON.

    python benchmarks/triton_bwd_spills.py [--seq 1024]

Each configuration runs one backward ("dense" dkv) on random inputs; the compiled kernels' n_regs / n_spills
are read from Triton's per-device cache of each jitted function.
"""

from __future__ import annotations

import argparse
import json

import torch

from dsa_kernels import BWD_SWEEP, DENSE_SWEEP, DQK, DV, H, TOPK  # benchmarks/, the script's folder


def compiled_stats(fn):
    """(name, n_regs, n_spills) of every compiled variant of a jitted Triton function on the current device."""
    out = []
    for cache in fn.device_caches.values():
        for k in cache[0].values():
            out.append(dict(n_regs=getattr(k, "n_regs", None), n_spills=getattr(k, "n_spills", None)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=1024)
    args = ap.parse_args()
    from megatron_glm5.ops import triton_sparse_mla as tsm

    s = args.seq
    q = torch.randn(s, H, DQK, device="cuda").bfloat16()
    kv = torch.randn(s, DQK, device="cuda").bfloat16()
    d_out = torch.randn(s, H, DV, device="cuda").bfloat16()
    idx = torch.rand(s, s, device="cuda").tril().topk(min(TOPK, s), -1).indices.int()
    out, lse = tsm.sparse_mla_fwd(q, kv, idx, DQK ** -0.5, DV)
    rows = []
    for cfg in BWD_SWEEP + DENSE_SWEEP:
        for fn in (tsm._bwd_kernel, tsm._dense_dkv_kernel):
            for cache in fn.device_caches.values():
                cache[0].clear()
        try:
            tsm.sparse_mla_bwd(q, kv, idx, out, lse, d_out, None, DQK ** -0.5, DV, deterministic=False,
                               config=dict(tsm.BWD_CONFIG, DK="dense", **cfg))
            torch.cuda.synchronize()
            rows.append(dict(config=cfg, kernel1=compiled_stats(tsm._bwd_kernel),
                             dense_dkv=compiled_stats(tsm._dense_dkv_kernel)))
        except Exception as e:  # e.g. out of shared memory
            rows.append(dict(config=cfg, error=str(e).splitlines()[0][:200]))
        print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
