"""Peer rows for benchmarks/dsa_kernels.py: TileLang's public DeepSeek-V3.2 example kernels (sparse MLA forward and
backward), timed on the same inputs, in the same process, with the same timer as our kernels.

    python benchmarks/peer_tilelang.py --examples DIR [--seqs 4096 32768] [--json out.json]

(standalone: the sparse MLA FORWARD rows only -- each of our TileLang forward configurations, then the plain,
pipelined and seesaw examples -- per sequence length, in one process.)

The examples are not part of this repository (we ship only code we wrote); pass the ``examples/deepseek_v32``
folder of a tile-ai/tilelang checkout with ``benchmarks/dsa_kernels.py --tilelang-examples DIR``.  The folder needs
``sparse_mla_fwd.py``, ``sparse_mla_bwd.py`` and ``utils.py`` (``sparse_mla_fwd_pipelined.py`` and
``sparse_mla_fwd_seesaw.py`` are timed when present); the rows were measured with tile-ai/tilelang a35008a4 and
tilelang 0.1.15.

Their interface is batched ([B, S, H, 576] queries, [B, S_kv, groups, 576] latent keys, [B, S, groups, top-k]
int32 indices, an index >= S_kv is an unused slot, causal masking by position inside the kernel); the rows use
batch 1, one kv group and our indexer's top-k with our -1 padding mapped to S_kv.  The plain forward is
``sparse_mla_fwd_interface`` (default block_I 64, 2 stages, 256 threads); the pipelined and seesaw ones are their
``sparse_mla_fwd_interface(q, kv, idx, q_start_index_s=0, kv_stride=1)`` (warp-specialised, 384 threads); the
backward is ``sparse_mla_bwd`` (its Delta preprocess, the main kernel with fp32 atomic dkv, the dkv cast) given the
example forward's out and lse.  A forward example that fails to compile or run here is logged, not timed.
FLOP counts are ours (the module docstring of dsa_kernels.py), so their TFLOP/s is comparable with our rows; their own
script counts the backward 1.2% higher.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import sys
import time

import torch

REQUIRED = ("sparse_mla_fwd.py", "sparse_mla_bwd.py", "utils.py")
#: the examples' warp-specialised forwards (module name, row label), timed when the folder has them
WS_EXAMPLES = (("sparse_mla_fwd_pipelined", "pipelined"), ("sparse_mla_fwd_seesaw", "seesaw"))


def load_examples(folder: str):
    """(forward module, backward module) of the TileLang examples in folder; a clear error if it is not one."""
    missing = [f for f in REQUIRED if not os.path.isfile(os.path.join(folder, f))]
    if missing:
        raise SystemExit(f"--tilelang-examples {folder}: not TileLang's examples/deepseek_v32 folder "
                         f"(missing {', '.join(missing)})")
    sys.path.insert(0, os.path.abspath(folder))  # the examples import each other and their utils.py by name
    return importlib.import_module("sparse_mla_fwd"), importlib.import_module("sparse_mla_bwd")


def example_inputs(p, dv):
    """The examples' batched views of problem p (views: p.refill() refreshes them in place) and int32 indices with
    our -1 padding mapped to S_kv."""
    seq = p.seq
    q = p.q.view(1, seq, p.q.shape[1], p.q.shape[2])
    kv = p.kv.view(1, seq, 1, p.kv.shape[1])
    d_out = p.d_out.view(1, seq, p.d_out.shape[1], dv)
    idx = p.indices.to(p.q.device)
    idx = idx.masked_fill((idx < 0) | (idx >= seq), seq).to(torch.int32).view(1, seq, 1, -1).contiguous()
    return q, kv, d_out, idx


def add_fwd_rows(p, folder, add, timed, reps, dv, log=print):
    """Times the plain example forward and, when present, the pipelined and seesaw ones; returns the plain one's
    (out, lse)."""
    fwd_mod, _ = load_examples(folder)
    q, kv, _, idx = example_inputs(p, dv)

    def fwd():
        return fwd_mod.sparse_mla_fwd_interface(q, kv, idx, sm_scale=p.scale, d_v=dv)

    fwd()  # compile outside the timing
    add("sparse_mla fwd (TileLang example)", timed(fwd, p.refill, reps), p.fwd_flop)
    for name, label in WS_EXAMPLES:
        if not os.path.isfile(os.path.join(folder, name + ".py")):
            continue
        try:
            mod = importlib.import_module(name)
            run = functools.partial(mod.sparse_mla_fwd_interface, q, kv, idx, 0, 1, sm_scale=p.scale)
            run()
            add(f"sparse_mla fwd (TileLang example, {label})", timed(run, p.refill, reps), p.fwd_flop)
        except Exception as e:  # an example written for a newer TileLang than the installed one
            why = str(e).splitlines()[0][:200] if str(e) else ""
            log(f"(TileLang example {label} not timed: {type(e).__name__}: {why})")
    return fwd()


def add_rows(p, folder, add, timed, reps, dv):
    """Times the example forwards (add_fwd_rows) and the example backward on problem p (benchmarks.kernels.Problem)
    through add(label, ms, flop)."""
    _, bwd_mod = load_examples(folder)
    out, lse = add_fwd_rows(p, folder, add, timed, reps, dv)
    q, kv, d_out, idx = example_inputs(p, dv)

    def bwd():
        return bwd_mod.sparse_mla_bwd(q, kv, out, d_out, idx, lse, sm_scale=p.scale)

    bwd()
    add("sparse_mla bwd (TileLang example, atomic)", timed(bwd, p.refill, reps), 2.5 * p.fwd_flop)


def main(argv=None):
    """The forward rows alone: ours (every configuration of ours_fwd_configs) and the examples, per sequence."""
    import dsa_kernels as kernels  # benchmarks/, the script's folder

    from megatron_glm5.ops import tilelang_sparse_mla as tlm
    from megatron_glm5.ops import tilelang_sparse_mla_ws as tlws

    ap = argparse.ArgumentParser(description="TileLang sparse MLA forward: ours against TileLang's examples")
    ap.add_argument("--examples", required=True, metavar="DIR", help="TileLang's examples/deepseek_v32 folder")
    ap.add_argument("--seqs", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/peer_tilelang.py needs a CUDA GPU")
    ours = (("warp-specialised", tlws.WS_CONFIG), ("warp-specialised, exact exp2", tlws.WS_EXACT_CONFIG),
            ("warp-specialised, gathering unused slots", tlws.WS_GATHER_ALL_CONFIG),
            ("warp-specialised, buffers freed after the pair", tlws.WS_LATE_RELEASE_CONFIG),
            ("warp-specialised, 32-row blocks, four buffers", tlws.WS32_CONFIG),
            ("warp-specialised, 32-row blocks, early release", tlws.WS32_EARLY_CONFIG),
            ("plain loop", tlm.FWD_CONFIG), ("pipelined, 64 rows", tlm.PIPELINED64_CONFIG))
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, reps=args.reps,
                  command="python benchmarks/peer_tilelang.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                  flop_convention="fwd = 2*T*h*topk*(576+512)", rows=[])
    t0 = time.time()
    for seq in args.seqs:
        p = kernels.Problem(seq)

        def add(kernel, ms, flop=None):
            row = dict(seq=seq, kernel=kernel, ms=round(ms, 3), tflops=round(flop / ms / 1e9, 1))
            result["rows"].append(row)
            print(f"S={seq:6d} {kernel:48s} {ms:9.3f} ms {row['tflops']:7.1f} TFLOP/s", flush=True)

        runs, ref_o, ref_l = [], None, None
        for label, cfg in ours:  # compile, and check each configuration against the first on the same inputs
            run = functools.partial(tlm.tilelang_sparse_fwd, p.q, p.kv, p.indices, p.scale, kernels.DV, config=cfg)
            try:
                o, l_ = run()
            except Exception as e:
                print(f"(ours, {label}, not timed: {type(e).__name__}: {str(e).splitlines()[0][:200]})", flush=True)
                continue
            runs.append((label, run))
            if ref_o is None:
                ref_o, ref_l = o.float(), l_
            else:
                fin = torch.isfinite(ref_l)
                row_err = ((o.float() - ref_o).norm() / ref_o.norm()).item()
                print(f"   {label}: rel L2 of out vs {runs[0][0]} {row_err:.2e}, lse max abs diff "
                      f"{(l_[fin] - ref_l[fin]).abs().max().item():.2e}", flush=True)
        del ref_o, ref_l
        for label, run in runs:  # timed with fresh inputs (p.refill) between repetitions
            add(f"sparse_mla fwd (our TileLang, {label})", kernels.timed(run, p.refill, args.reps), p.fwd_flop)
        add_fwd_rows(p, args.examples, add, kernels.timed, args.reps, kernels.DV)
        del p
        torch.cuda.empty_cache()
    result["wall_s"] = round(time.time() - t0, 1)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
