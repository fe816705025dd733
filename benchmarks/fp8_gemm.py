"""The block-scaled FP8 GEMMs of megatron_glm5/ops/triton_fp8_gemm.py at GLM-5.3's full-width shapes: TFLOP/s and
error of design A (weight-only: fp8 tiles dequantised in registers, bf16 MMA), design B (FP8 x FP8: activations
quantised by rows of 128, e4m3 MMA) and the bf16 reference (torch.matmul on the dequantised weight; the grouped
shapes through torch._grouped_mm), forward (y = x W^T) and input gradient (dx = dy W).

    python benchmarks/fp8_gemm.py [--out fp8_gemm.json] [--sweep] [--reps 15] [--only NAME]

Dense shapes: the attention projections q_a, q_b, kv_a, kv_b, o and the dense fc1 at M = 4096 tokens. Grouped:
32 local experts (256 at EP8), the routed w1 [2*2048, 6144] and w2 [6144, 2048], 8 / 128 / 1024 tokens per expert
(1024 = 4096 tokens x top-8 x 8 ranks / 256 experts). Timing: CUDA events around each call after warm-up, the
median of --reps; the inputs (and weights) rotate among several sets of fresh random data so that no rep reads
what the last one left in L2. Error: ||out - ref|| / ||ref|| against an fp32 product with the exact dequantised
weight, on fresh random data (another seed). --sweep also times a few tile configurations per design and regime
on the first problems (SWEEP_ON), and each winner becomes the module's configuration for the problems after it
(the JSON's "configs" holds the final table: megatron_glm5/ops/triton_fp8_gemm.py's _CONFIGS is set from it).
Prints a line per problem and writes the JSON document to --out.
Needs only torch and triton (the kernel module is loaded from its file, not through the megatron_glm5 package).
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import shlex
import sys
from pathlib import Path

import torch

import cuda_timing  # benchmarks/, the script's folder

ROOT = Path(__file__).resolve().parents[1]


def load_kernels():
    spec = importlib.util.spec_from_file_location("triton_fp8_gemm", ROOT / "megatron_glm5/ops/triton_fp8_gemm.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


K = load_kernels()
DENSE = {"q_a": (2048, 6144), "q_b": (64 * 256, 2048), "kv_a": (576, 6144), "kv_b": (64 * (192 + 256), 512),
         "o": (6144, 64 * 256), "fc1": (2 * 12288, 6144)}
GROUPED = {"w1": (2 * 2048, 6144), "w2": (6144, 2048)}
DENSE_M = 4096
EXPERTS = 32
TOKENS_PER_EXPERT = (8, 128, 1024)
# the problems where tile configurations are swept (--sweep), first; each winner becomes the module's configuration
# for its (design, regime, direction) before the other problems run
SWEEP_ON = ("fc1.fwd", "fc1.dgrad", "experts.w1.t8.fwd", "experts.w1.t8.dgrad", "experts.w1.t1024.fwd",
            "experts.w1.t1024.dgrad")
_ROWS_LEFT = [dict(BM=128, BO=256, BR=64, num_warps=8, num_stages=3, SW=0, WS=1),
              dict(BM=128, BO=128, BR=64, num_warps=8, num_stages=4, SW=0, WS=1),
              dict(BM=128, BO=256, BR=128, num_warps=8, num_stages=3, SW=0),
              dict(BM=128, BO=128, BR=128, num_warps=8, num_stages=4, SW=0),
              dict(BM=256, BO=128, BR=128, num_warps=8, num_stages=3, SW=0)]
SWEEP = {
    "large": [dict(BM=128, BO=128, BR=64, num_warps=8, num_stages=4, WS=1),
              dict(BM=128, BO=128, BR=128, num_warps=8, num_stages=3),
              dict(BM=128, BO=256, BR=64, num_warps=8, num_stages=3, WS=1)] + _ROWS_LEFT,
    "small": [dict(BM=16, BO=128, BR=128, num_warps=4, num_stages=4),
              dict(BM=16, BO=128, BR=128, num_warps=4, num_stages=4, WS=1),
              dict(BM=16, BO=64, BR=128, num_warps=4, num_stages=6)],
}
# the input gradient also tries these with TQ (the reduction along contiguous codes)
SWEEP_TQ = {"large": _ROWS_LEFT[2:], "small": SWEEP["small"][:1]}


def random_weight(shape, gen, device="cuda"):
    n, k = shape[-2:]
    q = (torch.randn(shape, generator=gen, device=device) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(*shape[:-2], -(-n // 128), -(-k // 128), generator=gen, device=device) * 2e-4 + 1e-4
    return q, s


def dequant(q, s, dtype):
    n, k = q.shape[-2:]
    full = s.repeat_interleave(128, dim=-2)[..., :n, :].repeat_interleave(128, dim=-1)[..., :k]
    return (q.float() * full).to(dtype)


def offsets_for(tokens):
    return torch.full((EXPERTS,), tokens, dtype=torch.int32, device="cuda").cumsum(0).to(torch.int32)


def median_ms(fn, sets, reps, warmup=3):
    """fn over the input sets in turn (a fresh set each run), timed by cuda_timing.median_ms."""
    turn = iter(range(1 << 62))
    current = []
    return cuda_timing.median_ms(lambda: fn(*current[-1]), reps, warmup,
                                 refill=lambda: current.append(sets[next(turn) % len(sets)]))


def rel_l2(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def problems():
    """(name, kind, weight shape, rows, grouped tokens per expert or None)."""
    for name, shape in DENSE.items():
        for kind in ("fwd", "dgrad"):
            yield f"{name}.{kind}", kind, shape, DENSE_M, None
    for name, shape in GROUPED.items():
        for tpe in TOKENS_PER_EXPERT:
            for kind in ("fwd", "dgrad"):
                yield f"experts.{name}.t{tpe}.{kind}", kind, (EXPERTS, *shape), EXPERTS * tpe, tpe


def kernel_call(kind, grouped, design, config):
    if grouped:
        fn = K.fp8_grouped_gemm if kind == "fwd" else K.fp8_grouped_gemm_dgrad
        return lambda a, q, s, off: fn(a, q, s, off, design=design, config=config)
    fn = K.fp8_gemm if kind == "fwd" else K.fp8_gemm_dgrad
    return lambda a, q, s, off: fn(a, q, s, design=design, config=config)


def reference_weight(q, s, kind, grouped):
    """The bf16 reference's weight: dequantised; for the grouped input gradient in the column-major layout that
    torch._grouped_mm takes (a copy made outside the timed region)."""
    w = dequant(q, s, torch.bfloat16)
    return w.transpose(-2, -1).contiguous().transpose(-2, -1) if grouped and kind == "dgrad" else w


def reference_call(kind, grouped):
    """bf16 on the dequantised weight (the weight argument is ``reference_weight``'s)."""
    if grouped:
        if kind == "fwd":
            return lambda a, w, _, off: torch._grouped_mm(a, w.transpose(-2, -1), offs=off)
        return lambda a, w, _, off: torch._grouped_mm(a, w, offs=off)
    return (lambda a, w, _, off: a @ w.T) if kind == "fwd" else (lambda a, w, _, off: a @ w)


def measure(name, kind, shape, rows, tpe, reps, sweep, gen):
    grouped = tpe is not None
    n, k = shape[-2:]
    width = n if kind == "dgrad" else k
    flops = 2.0 * rows * n * k
    n_w = 2 if shape[-1] * shape[-2] * (shape[0] if grouped else 1) > 5e7 else 3
    weights = [random_weight(shape, gen) for _ in range(n_w)]
    off = offsets_for(tpe) if grouped else None
    inputs = [torch.randn(rows, width, generator=gen, device="cuda").bfloat16() for _ in range(3)]
    sets = [(inputs[i % 3], *weights[i % n_w], off) for i in range(6)]
    row = dict(name=name, kind=kind, weight=list(shape), rows=rows, tokens_per_expert=tpe, gflop=flops / 1e9)
    # error on fresh data (another seed): fp32 product with the exact dequantised weight
    g2 = torch.Generator(device="cuda").manual_seed(1234)
    qe, se = random_weight(shape, g2)
    xe = torch.randn(rows, width, generator=g2, device="cuda").bfloat16()
    w32 = dequant(qe, se, torch.float32)
    ref = reference_call(kind, grouped)
    if grouped:
        exact = torch.cat([xe[i * tpe:(i + 1) * tpe].float() @ (w32[i].T if kind == "fwd" else w32[i])
                           for i in range(EXPERTS)])
    else:
        exact = xe.float() @ (w32.T if kind == "fwd" else w32)
    wb = reference_weight(qe, se, kind, grouped)
    row["bf16_ref"] = dict(err=rel_l2(ref(xe, wb, None, off), exact))
    del wb, w32
    bf_sets = [(inputs[i], reference_weight(*weights[i % n_w], kind, grouped), None, off) for i in range(min(2, n_w))]
    row["bf16_ref"]["ms"] = median_ms(ref, bf_sets, reps)
    row["bf16_ref"]["tflops"] = flops / row["bf16_ref"]["ms"] / 1e9
    del bf_sets
    reg = K.regime(rows / (EXPERTS if grouped else 1))
    for design in K.DESIGNS:
        layout = "grouped" if grouped else "dense"
        default = K._config(design, rows / (EXPERTS if grouped else 1), kind, layout, None)
        configs = [default]
        if sweep and name in SWEEP_ON:
            extra = SWEEP[reg] + ([dict(c, TQ=1) for c in SWEEP_TQ[reg] + [default]] if kind == "dgrad" else [])
            for c in extra:
                if (design == "A" or not c.get("WS")) and c not in configs:
                    configs.append(c)
        tried = []
        for cfg in configs:
            fn = kernel_call(kind, grouped, design, cfg)
            try:
                ms = median_ms(fn, sets, reps)
                tried.append(dict(config=cfg, ms=ms, tflops=flops / ms / 1e9))
            except Exception as e:  # a configuration that does not compile or run is recorded, not fatal
                tried.append(dict(config=cfg, error=f"{type(e).__name__}: {str(e)[:200]}"))
        ok = [t for t in tried if "ms" in t]
        res = dict(tried=tried)
        if ok:
            best = min(ok, key=lambda t: t["ms"])
            if len(configs) > 1:  # the winner becomes the configuration of its (design, regime, direction)
                K._CONFIGS[design, reg, kind, layout] = dict(best["config"])
            res.update(ms=best["ms"], tflops=best["tflops"], config=best["config"])
            try:
                res["err"] = rel_l2(kernel_call(kind, grouped, design, best["config"])(xe, qe, se, off), exact)
            except Exception as e:
                res["err_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        row[design] = res
    return row


def quantize_figures(gen, reps):
    n, k = DENSE["fc1"]
    ws = [torch.randn(n, k, generator=gen, device="cuda").bfloat16() for _ in range(2)]
    ms = median_ms(lambda w: K.fp8_quantize_blocks(w), [(w,) for w in ws], reps)
    bytes_moved = n * k * 3 + 4 * (n // 128) * (k // 128)
    xs = [torch.randn(DENSE_M, k, generator=gen, device="cuda").bfloat16() for _ in range(3)]
    ms_rows = median_ms(lambda x: K.quantize_rows(x), [(x,) for x in xs], reps)
    return dict(blocks=dict(shape=[n, k], ms=ms, gbps=bytes_moved / ms / 1e6),
                rows=dict(shape=[DENSE_M, k], ms=ms_rows, gbps=(DENSE_M * k * 3 + DENSE_M * k // 32) / ms_rows / 1e6))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--only", default=None, help="run only the problems whose name contains this")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: benchmarks/fp8_gemm.py needs a CUDA GPU")
    import triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    result = dict(benchmark="fp8_gemm", date=datetime.date.today().isoformat(),
                  device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  command="python " + " ".join(shlex.quote(a) for a in sys.argv), default_design=K.DEFAULT_DESIGN,
                  rows=[])
    for prob in sorted(problems(), key=lambda p: p[0] not in SWEEP_ON):
        if args.only and args.only not in prob[0]:
            continue
        try:
            row = measure(*prob, args.reps, args.sweep and prob[0] in SWEEP_ON, gen)
        except Exception as e:  # one problem's failure is recorded; the others still run
            result["rows"].append(dict(name=prob[0], error=f"{type(e).__name__}: {str(e)[:300]}"))
            print(f"{prob[0]:28s} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            torch.cuda.empty_cache()
            continue
        result["rows"].append(row)
        print(f"{row['name']:28s} bf16 {row['bf16_ref']['tflops']:7.1f} TF/s err {row['bf16_ref']['err']:.1e} | "
              + " | ".join(f"{d} {row[d].get('tflops', float('nan')):7.1f} err {row[d].get('err', float('nan')):.1e} "
                           f"{row[d].get('config')}" for d in K.DESIGNS), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
        torch.cuda.empty_cache()
    result["configs"] = {"/".join(key): cfg for key, cfg in K._CONFIGS.items()}
    try:
        result["quantize"] = quantize_figures(gen, args.reps)
    except Exception as e:
        result["quantize"] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(json.dumps(result["quantize"]))


if __name__ == "__main__":
    main()
