"""Peer rows for benchmarks/kernels.py: TileLang's public DeepSeek-V3.2 example kernels (sparse MLA forward and
backward), timed on the same inputs, in the same process, with the same timer as our kernels.

The examples are not part of this repository (we ship only code we wrote); pass the ``examples/deepseek_v32``
folder of a tile-ai/tilelang checkout with ``benchmarks/kernels.py --tilelang-examples DIR``.  The folder needs
``sparse_mla_fwd.py``, ``sparse_mla_bwd.py`` and ``utils.py``; the rows were measured with tile-ai/tilelang
a35008a4 and tilelang 0.1.15.

Their interface is batched ([B, S, H, 576] queries, [B, S_kv, groups, 576] latent keys, [B, S, groups, top-k]
int32 indices, an index >= S_kv is an unused slot, causal masking by position inside the kernel); the rows use
batch 1, one kv group and our indexer's top-k with our -1 padding mapped to S_kv.  The forward is
``sparse_mla_fwd_interface`` (default block_I 64, 2 stages, 256 threads); the backward is ``sparse_mla_bwd``
(its Delta preprocess, the main kernel with fp32 atomic dkv, the dkv cast) given the example forward's out and lse.
FLOP counts are ours (the module docstring of kernels.py), so their TFLOP/s is comparable with our rows; their own
script counts the backward 1.2% higher.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

REQUIRED = ("sparse_mla_fwd.py", "sparse_mla_bwd.py", "utils.py")


def load_examples(folder: str):
    """(forward module, backward module) of the TileLang examples in folder; a clear error if it is not one."""
    missing = [f for f in REQUIRED if not os.path.isfile(os.path.join(folder, f))]
    if missing:
        raise SystemExit(f"--tilelang-examples {folder}: not TileLang's examples/deepseek_v32 folder "
                         f"(missing {', '.join(missing)})")
    sys.path.insert(0, os.path.abspath(folder))  # the examples import each other and their utils.py by name
    return importlib.import_module("sparse_mla_fwd"), importlib.import_module("sparse_mla_bwd")


def add_rows(p, folder, add, timed, reps, dv):
    """Times the example forward and backward on problem p (benchmarks.kernels.Problem) through add(label, ms,
    flop)."""
    fwd_mod, bwd_mod = load_examples(folder)
    seq = p.seq
    q = p.q.view(1, seq, p.q.shape[1], p.q.shape[2])  # views: p.refill() refreshes them in place
    kv = p.kv.view(1, seq, 1, p.kv.shape[1])
    d_out = p.d_out.view(1, seq, p.d_out.shape[1], dv)
    idx = p.indices.to(p.q.device)
    idx = idx.masked_fill((idx < 0) | (idx >= seq), seq).to(torch.int32).view(1, seq, 1, -1).contiguous()

    def fwd():
        return fwd_mod.sparse_mla_fwd_interface(q, kv, idx, sm_scale=p.scale, d_v=dv)

    fwd()  # compile outside the timing
    add("sparse_mla fwd (TileLang example)", timed(fwd, p.refill, reps), p.fwd_flop)
    out, lse = fwd()

    def bwd():
        return bwd_mod.sparse_mla_bwd(q, kv, out, d_out, idx, lse, sm_scale=p.scale)

    bwd()
    add("sparse_mla bwd (TileLang example, atomic)", timed(bwd, p.refill, reps), 2.5 * p.fwd_flop)
