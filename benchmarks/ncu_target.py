"""One call of our sparse-MLA kernels between cudaProfilerStart / Stop at GLM-5 shapes, for Nsight Compute.

    ncu --clock-control none --profile-from-start off --set full --print-details all \
        python3 benchmarks/ncu_target.py --op fwd --seq 32768 [--config staggered] [--unused]

Ops: ``fwd`` -- our warp-specialised TileLang forward in one of the configurations that benchmarks/dsa_kernels.py
times in rounds (--config: default, whole blocks, L2 hints, async wgmma, persistent, persistent async,
persistent bounded, bounded, staggered); ``--unused`` gives it every top-k
slot unused (nothing gathered after the first block pair, every product still run: its counters without the
gathers; not with bounded, which then runs no step);
``bwd`` -- the ``--attn tilelang`` backward (our scores kernel + cuBLAS; --pieces N: BWD_CONFIG DENSE_PIECE_ROWS).
The problem is dsa_kernels.Problem's (64 heads, d_qk 576, d_v 512, top-k 2048, causal top-k from our Triton
indexer, bf16); the op runs twice before the profiled call (compiles, warms up) outside the profiled range.
Needs a CUDA GPU and tilelang.  ``--clock-control none`` keeps the GPU's clocks as they are (the device notes).
"""
from __future__ import annotations

import argparse
import sys

import torch


def forward_configs() -> dict:
    """name -> our forward's configuration: dsa_kernels.fwd_round_configs, named by their row suffixes."""
    from dsa_kernels import fwd_round_configs

    return {(suffix.split(", ")[2] if suffix.count(",") > 1 else "default"): cfg
            for suffix, cfg in fwd_round_configs()}


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", choices=("fwd", "bwd"), required=True)
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--config", default="default", help="fwd: the forward's configuration (dsa_kernels' rounds)")
    ap.add_argument("--unused", action="store_true", help="fwd: every top-k slot unused (no gathers after the "
                                                          "first block pair)")
    ap.add_argument("--pieces", type=int, default=None, help="bwd: BWD_CONFIG DENSE_PIECE_ROWS")
    args = ap.parse_args(argv)
    if args.op == "fwd":
        names = forward_configs()
        if args.config not in names:
            ap.error(f"--config {args.config!r}: one of {', '.join(names)}")
        if args.unused and names[args.config].get("bounded"):
            ap.error("--unused: bounded runs no step with every slot unused")
    elif args.config != "default" or args.unused:
        ap.error("--config and --unused are the forward's (--op fwd)")
    if args.pieces is not None and (args.op != "bwd" or args.pieces < 1):
        ap.error("--pieces takes a positive number of rows, with --op bwd")
    return args


def main(argv=None):
    args = parse(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/ncu_target.py needs a CUDA GPU")
    from dsa_kernels import DV, Problem

    from megatron_glm5.ops import tilelang_sparse_mla, tilelang_sparse_mla_bwd_ws, tilelang_sparse_mla_ws

    p = Problem(args.seq)
    if args.op == "fwd":
        idx = torch.full_like(p.indices, -1) if args.unused else p.indices
        cfg = forward_configs()[args.config]

        def run():
            tilelang_sparse_mla.tilelang_sparse_fwd(p.q, p.kv, idx, p.scale, DV, config=cfg)
    else:
        out, lse = tilelang_sparse_mla_ws.tilelang_sparse_fwd_ws(p.q, p.kv, p.indices, p.scale, DV)
        hs = torch.empty(p.indices.shape, dtype=torch.float32, device="cuda")
        cfg = None if args.pieces is None else dict(DENSE_PIECE_ROWS=args.pieces)

        def run():
            tilelang_sparse_mla_bwd_ws.tilelang_sparse_bwd_dense(p.q, p.kv, p.indices, out, lse, p.d_out, None,
                                                                 p.scale, DV, deterministic=False, head_sums=hs,
                                                                 config=cfg)
    for _ in range(2):
        run()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    run()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"profiled one {args.op} call at S {args.seq} ({vars(args)})")


if __name__ == "__main__":
    main()
