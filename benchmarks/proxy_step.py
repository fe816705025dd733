"""Model-level benchmark: one training step (forward + backward) of a GLM-5 proxy, our stack against transformers'
GlmMoeDsaForCausalLM, in the same process, on the same config and the same random tokens.

    python benchmarks/proxy_step.py [--preset glm5 --layers 4 --dense 3 --seq 4096 --attn triton] [--json out.json]
        [--cross-entropy-fusion chunked] [--impls ours] [--fusions none,auto] [--profile 40]

Default model: GLM-5 width, 4 layers (3 dense + 1 MoE with all 256 experts), no MTP, bf16, batch 1 x 4096 tokens
(the shape of the transformers baseline in ../shared/GLM5_REFERENCE.md: 274 ms/step, 14.9k tokens/s).
Ours: ``build_model`` on one GPU (DSA sparse stage, indexer KL loss on with ``--indexer-loss-coeff``), per-token
LM loss mean, backward. Transformers: the same config through ``GLM5Config.to_hf``, ``labels=`` loss, backward
(it has no indexer loss: its indexer is not trained). No optimizer step for either (the proxy's Adam states do not
fit one GPU with 256 experts). Gradients are dropped (set to None) between steps, outside the timed region.
Timing: CUDA events around forward + backward, after --warmup steps, median of --steps, fresh random token ids for
every step. Model FLOPs from megatron_glm5.training.flops (sparse attention at top-k, the indexer over the causal
window, 3x forward); MFU against --peak-tflops (751: the bf16 8192^3 matmul measured on the H200).
``--profile N``: one more step under torch.profiler per impl: its N most expensive ops, and on a GPU the step's
kernels by category (GEMMs, grouped experts, sparse attention, indexer, KL, MoE permute, elementwise, copies,
other; ``CATEGORIES`` classifies kernels by name) printed side by side and written to the JSON.
Below them: GPU busy (the union of the profiled step's kernel / copy intervals), its span (first start to last
end) and GPU idle (the timed median step minus GPU busy: the time the step waits on the host).
``--fusions none,auto``: ours before and after the fused elementwise regions (model/fusions.py) in one run.
On a CPU (``--device cpu``, fp32, a tiny preset) the same code runs as a smoke test with perf_counter timing.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_glm5.config import GLM5Config  # noqa: E402
from megatron_glm5.training.flops import training_flops_per_token  # noqa: E402


def config_overrides(items, config: dict, flag: str) -> dict:
    """KEY=VALUE strings as a dict of overrides of ``config``'s keys (VALUE a Python literal, else a string)."""
    import ast

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in config:
            raise SystemExit(f"{flag}: expected KEY=VALUE with KEY one of {sorted(config)}, got {item!r}")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def proxy_config(preset: str, layers: int, dense: int) -> GLM5Config:
    cfg = GLM5Config.from_preset(preset)
    return cfg.replace(num_hidden_layers=layers, first_k_dense_replace=dense, num_nextn_predict_layers=0)


class _Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    """CUDA events around the step (ms), and host_ms: how long the host took to issue it (to the end of the
    step's Python code, before waiting for the GPU) -- close to ms when the step is bound by the host."""

    def __enter__(self):
        self.t0 = time.perf_counter()
        self.mid = self.host_mid = None
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        return self

    def mark(self):
        """Between the forward and the backward: fwd_ms / bwd_ms (GPU) and host_fwd_ms (host) split at it."""
        self.host_mid = (time.perf_counter() - self.t0) * 1e3
        if self.cuda:
            self.mid = torch.cuda.Event(enable_timing=True)
            self.mid.record()

    def __exit__(self, *exc):
        self.host_ms = (time.perf_counter() - self.t0) * 1e3
        if self.cuda:
            self.end.record()
            torch.cuda.synchronize()
            if self.mid is not None:
                self.fwd_ms, self.bwd_ms = self.start.elapsed_time(self.mid), self.mid.elapsed_time(self.end)
            self.ms = self.start.elapsed_time(self.end)
        else:
            self.ms = (time.perf_counter() - self.t0) * 1e3


def build_ours(cfg: GLM5Config, dtype, device, attn: str, indexer_loss_coeff: float, permute_fusion=None,
               cross_entropy_fusion: str = "none", fusions: str = "auto"):
    """``fusions``: a --fusions choice; "auto-static" is auto with torch.compile's automatic dynamic shapes off
    (every new shape compiles a static kernel; a measurement of what the dynamic kernels cost)."""
    import torch._dynamo

    from megatron_glm5.model.fusion_flags import config_overrides
    from megatron_glm5.model.model import build_model

    torch._dynamo.reset()  # each build compiles its own regions (in its warm-up steps)
    torch._dynamo.config.automatic_dynamic_shapes = fusions != "auto-static"
    fusions = "auto" if fusions == "auto-static" else fusions
    model = build_model(cfg, mtp=False, params_dtype=dtype, bf16=dtype == torch.bfloat16, dsa_backend=attn,
                        dsa_stage="sparse", dsa_indexer_loss_coeff=indexer_loss_coeff,
                        moe_triton_permute_fusion=permute_fusion, cross_entropy_fusion=cross_entropy_fusion,
                        **config_overrides(fusions, cuda=device.type == "cuda"))
    return model.to(device).train()


def step_ours(model, ids, mark=None):
    loss = model(ids[:, :-1], labels=ids[:, 1:]).float().mean()
    if mark is not None:
        mark()
    loss.backward()
    return loss


def build_transformers(cfg: GLM5Config, dtype, device):
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    hf_cfg = GlmMoeDsaConfig(**cfg.to_hf())
    with torch.device(device):
        model = GlmMoeDsaForCausalLM(hf_cfg).to(dtype)
    return model.train()


def step_transformers(model, ids, mark=None):
    out = model(input_ids=ids[:, :-1], labels=ids[:, 1:])
    if mark is not None:
        mark()
    out.loss.backward()
    return out.loss


# Kernel categories of the profile, first match wins (lower-case substrings of the kernel name). Inductor's
# kernels (torch.compile: triton_poi_/triton_red_/triton_per_) are "elementwise" even when they concatenate.
CATEGORIES = (
    ("elementwise", ("_swiglu_",)),  # ops/triton_swiglu.py's kernels (their names end in _fwd_kernel / _bwd_kernel)
    ("KL", ("_head_prob_kernel", "head_probs_kernel", "_indexer_kl_kernel", "_selected_lse_kernel", "tilelang_kl",
            "kl_kernel")),
    ("indexer", ("_score_keys_kernel", "indexer")),
    ("sparse attention", ("_fwd_kernel", "_bwd_kernel", "_dkv_kernel", "_segment_sum_kernel", "sparse_mla", "flash",
                          "fmha",
                          "sdpa", "attention", "dsa")),
    ("MoE permute", ("_row_map_kernel", "_permute_kernel", "_unpermute_kernel")),
    ("grouped experts", ("grouped", "groupproblemshape", "group_gemm", "ptrarray")),
    ("GEMMs", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "matmul", "splitk", "sm90_", "sm80_", "ampere_")),
    ("elementwise", ("triton_poi_", "triton_red_", "triton_per_")),
    ("copies", ("_restore_zeros_kernel", "copy", "cat", "memcpy", "memset", "fill", "index", "gather", "scatter",
                "transpose", "pad")),
    ("elementwise", ("elementwise", "reduce", "softmax", "norm", "sort", "topk", "radix", "bitonic", "scan",
                     "triton_")),
)


def kernel_category(name: str) -> str:
    low = name.lower()
    for category, keys in CATEGORIES:
        if any(k in low for k in keys):
            return category
    return "other"


def category_table(kernels) -> dict:
    """kernels: (name, self device us, calls) of every GPU kernel of one step -> {category: {ms, calls, top}}."""
    out = {}
    for name, us, calls in kernels:
        c = out.setdefault(kernel_category(name), {"ms": 0.0, "calls": 0, "top": []})
        c["ms"] += us / 1e3
        c["calls"] += calls
        c["top"].append([name[:120], us / 1e3, calls])
    for c in out.values():
        c["top"] = sorted(c["top"], key=lambda t: -t[1])[:12]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["ms"]))


def _device_kernels(prof) -> list:
    """(kernel name, self device time in us, calls) of the GPU kernels in a torch.profiler run."""
    rows = []
    for e in prof.key_averages():
        if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        us = getattr(e, "self_device_time_total", None)
        us = e.self_cuda_time_total if us is None else us
        rows.append((e.key, float(us), int(e.count)))
    return rows


def gpu_busy_ms(intervals) -> tuple:
    """(union of the [start, end) intervals in ms, first start to last end in ms); intervals in us."""
    busy, span_end, cur_start, cur_end = 0.0, None, None, None
    ordered = sorted(intervals)
    for start, end in ordered:
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        busy += cur_end - cur_start
        span_end = max(e for _, e in ordered)
    span = (span_end - ordered[0][0]) if ordered else 0.0
    return busy / 1e3, span / 1e3


def _kernel_intervals(prof) -> list:
    """[start, end] in us of every GPU activity (kernels, copies, fills) of a torch.profiler run."""
    return [(e.time_range.start, e.time_range.end) for e in prof.events()
            if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]


def _profile(name, model, step, cfg, args, device, gen):
    """One more step under torch.profiler: the table of the --profile ops with the most device (else CPU) time, and
    on a GPU the step's kernels by category (``category_table``)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=gen).to(device)
    if args.manual_gc:
        gc.collect()
        gc.disable()
    with profile(activities=acts, with_stack=args.profile_sites) as prof:
        step(model, ids)
        if device.type == "cuda":
            torch.cuda.synchronize()
    if args.manual_gc:
        gc.enable()
    for p in model.parameters():
        p.grad = None
    if args.trace:  # the profiled step's timeline (chrome://tracing, Perfetto), one file per impl
        Path(args.trace).mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(Path(args.trace) / f"trace_{name.replace('/', '_')}.json.gz"))
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=args.profile, max_name_column_width=70)
    if args.profile_sites:
        table += "\n" + _op_sites(prof, key, args.profile)
    if device.type != "cuda":
        return table, None, None
    busy, span = gpu_busy_ms(_kernel_intervals(prof))
    return table, category_table(_device_kernels(prof)), {"busy_ms": busy, "span_ms": span}


def _op_sites(prof, key: str, rows: int) -> str:
    """The elementwise / copy ops of the step by the source line that called them (the innermost frame of
    megatron_glm5 / megatron-core / transformers; in the backward: the autograd node), most device time first.
    (With torch 2.11 on the H200 the forward ops came without their Python frames: only the backward's nodes.)"""
    import collections

    ops = ("copy", "cat", "mul", "add", "sub", "div", "cast", "_to_copy", "sum", "mean", "pow", "rsqrt", "silu",
           "sigmoid", "neg", "fill", "zero", "index", "gather", "scatter", "where", "exp", "log", "clamp",
           "contiguous", "triton_", "Compiled")
    sites = collections.Counter()
    for e in prof.events():  # with_stack: the Python frames are parent events of the aten ops
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA or not e.name.startswith("aten::"):
            continue
        us = getattr(e, key, 0.0)
        if not us or not any(o in e.name for o in ops):
            continue
        parent, where = e.cpu_parent, "(no Python frame recorded)"
        while parent is not None:
            if parent.name.startswith("autograd::engine::evaluate_function: "):
                where = "(backward) " + parent.name.split(": ", 1)[1]
                break
            if (any(k in parent.name for k in ("megatron_glm5/", "megatron/core/", "transformers/"))
                    and "cpu_literals" not in parent.name):  # not the CPU shim's function mode
                where = parent.name.split("site-packages/")[-1]
                break
            parent = parent.cpu_parent
        sites[(e.name, where)] += us
    lines = [f"{'op':32s} {'self device ms':>15s}  call site"]
    for (op, where), us in sites.most_common(rows):
        lines.append(f"{op[:32]:32s} {us / 1e3:15.2f}  {where[:110]}")
    return "\n".join(lines)


def _sync_sites(model, step, cfg, args, device, gen) -> list:
    """One more step with torch's CUDA sync debug mode: where (innermost frames of megatron_glm5 / megatron /
    transformers) the step makes the host wait for the GPU, with counts."""
    import collections
    import traceback
    import warnings

    sites = collections.Counter()
    old_show = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return old_show(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-1]
                  if any(k in f.filename for k in ("megatron_glm5", "megatron/core", "transformers"))]
        sites[" <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno}" for f in frames[-3:][::-1]) or filename] += 1

    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=gen).to(device)
    warnings.showwarning = show
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            step(model, ids)
            torch.cuda.set_sync_debug_mode("default")
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = old_show
    for p in model.parameters():
        p.grad = None
    return sites.most_common()


def run(name, build, step, cfg, args, device) -> dict:
    torch.manual_seed(0)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = build()
    gen = torch.Generator(device="cpu").manual_seed(1)
    times, host_times, losses, phases = [], [], [], []
    if args.manual_gc:  # Python's cyclic collector only between steps (outside the timing)
        gc.disable()
    for i in range(args.warmup + args.steps):
        if args.manual_gc:
            gc.collect()
        ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=gen).to(device)
        with _Timer(device) as t:
            loss = step(model, ids, mark=t.mark)
        losses.append(float(loss.detach()))
        if i >= args.warmup:
            times.append(t.ms)
            host_times.append(t.host_ms)
            if device.type == "cuda":
                phases.append((t.fwd_ms, t.bwd_ms, t.host_mid, t.host_ms - t.host_mid))
        for p in model.parameters():
            p.grad = None
        if hasattr(model, "zero_grad_buffer"):
            model.zero_grad_buffer()
    if args.manual_gc:
        gc.enable()
    ms = statistics.median(times)
    profile, categories, busy = (_profile(name, model, step, cfg, args, device, gen) if args.profile
                                 else (None, None, None))
    syncs = _sync_sites(model, step, cfg, args, device, gen) if args.sync_debug and device.type == "cuda" else None
    tokens = args.batch * args.seq
    flops = training_flops_per_token(cfg, args.seq, sparse=True) * tokens
    res = {"impl": name, "ms_per_step": ms, "host_ms_per_step": statistics.median(host_times),
           "phases_ms": dict(zip(("gpu_fwd", "gpu_bwd", "host_fwd", "host_bwd"),
                                 (statistics.median(x) for x in zip(*phases)))) if phases else None,
           "tokens_per_s": tokens / (ms / 1e3),
           "model_tflops": flops / (ms / 1e3) / 1e12, "losses": losses,
           "peak_memory_gib": (torch.cuda.max_memory_allocated() / 2**30) if device.type == "cuda" else None}
    if args.peak_tflops:
        res["mfu"] = res["model_tflops"] / args.peak_tflops
    if profile is not None:
        res["profile"] = profile
    if categories is not None:
        res["profile_categories"] = categories
    if busy is not None:  # GPU idle: the timed step minus the union of the profiled step's GPU intervals
        res["gpu_busy"] = dict(busy, idle_ms=ms - busy["busy_ms"])
    if syncs is not None:
        res["sync_sites"] = syncs
    del model
    gc.collect()
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="glm5")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dense", type=int, default=3, help="leading dense layers (the rest are MoE)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--attn", default="auto", help="our attention backend (--attn of the training scripts)")
    p.add_argument("--indexer-loss-coeff", type=float, default=1e-3)
    p.add_argument("--moe-permute-fusion", action=argparse.BooleanOptionalAction, default=None,
                   help="ours: the fused MoE token permute (default as in training: on with CUDA and triton)")
    p.add_argument("--cross-entropy-fusion", choices=("none", "chunked"), default="none",
                   help="ours: the output layer + cross entropy (--cross-entropy-fusion of the training scripts)")
    p.add_argument("--fusions", default="auto",
                   help="ours: --fusions of the training scripts (auto, none); a comma list runs ours once per "
                        "choice, e.g. none,auto (the rows are named ours/none, ours/auto)")
    p.add_argument("--impls", default="ours,transformers")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--peak-tflops", type=float, default=751.0)
    p.add_argument("--json", default=None)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after timing, profile one more step of each impl and print its N most expensive ops")
    p.add_argument("--profile-sites", action="store_true",
                   help="with --profile: also list the elementwise / copy ops by the source line that called them")
    p.add_argument("--manual-gc", action="store_true",
                   help="Python's garbage collector off during the timed steps, one collection before each step")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="with --profile: write the profiled step's timeline to DIR/trace_<impl>.json.gz")
    p.add_argument("--sync-debug", action="store_true",
                   help="after timing, list where one more step of each impl synchronises the host with the GPU")
    p.add_argument("--bwd-config", nargs="*", default=[], metavar="KEY=VALUE",
                   help="overrides of ops/triton_sparse_mla.BWD_CONFIG for our runs (e.g. ZEROS=restore: the dense "
                        "backward's plan, both --attn triton and tilelang)")
    p.add_argument("--kl-config", nargs="*", default=[], metavar="KEY=VALUE",
                   help="overrides of ops/triton_kl.KL_CONFIG for our runs (e.g. INDEXER_LSE=False)")
    args = p.parse_args(argv)
    if args.bwd_config or args.kl_config:
        from megatron_glm5.ops import triton_kl, triton_sparse_mla
        triton_sparse_mla.BWD_CONFIG.update(config_overrides(args.bwd_config, triton_sparse_mla.BWD_CONFIG,
                                                             "--bwd-config"))
        triton_kl.KL_CONFIG.update(config_overrides(args.kl_config, triton_kl.KL_CONFIG, "--kl-config"))

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu":
        args.peak_tflops = None
    cfg = proxy_config(args.preset, args.layers, args.dense)
    from megatron_glm5 import platform
    platform.initialize_model_parallel()
    choices = args.fusions.split(",")
    builders = {"transformers": (lambda: build_transformers(cfg, dtype, device), step_transformers)}
    for choice in choices:
        builders["ours" if len(choices) == 1 else f"ours/{choice}"] = (
            lambda choice=choice: build_ours(cfg, dtype, device, args.attn, args.indexer_loss_coeff,
                                             args.moe_permute_fusion, args.cross_entropy_fusion, choice), step_ours)
    names = [n for impl in args.impls.split(",")
             for n in ([impl] if impl != "ours" else [b for b in builders if b.startswith("ours")])]
    results = []
    for name in names:
        build, step = builders[name]
        results.append(run(name, build, step, cfg, args, device))
        if args.json:  # after each impl: a later one that fails leaves the earlier results
            Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    print(f"proxy: {args.preset} x {args.layers} layers ({args.dense} dense), seq {args.seq}, batch {args.batch}, "
          f"{dtype}, {device}")
    print(f"{'impl':14s} {'ms/step':>9s} {'tokens/s':>10s} {'TFLOP/s':>8s} {'MFU':>6s} {'peak GiB':>9s}")
    for r in results:
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
        mem = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] is not None else "-"
        print(f"{r['impl']:14s} {r['ms_per_step']:9.1f} {r['tokens_per_s']:10.0f} {r['model_tflops']:8.1f} "
              f"{mfu:>6s} {mem:>9s}")
    base = next((r for r in results if r["impl"] == "transformers"), None)
    for r in results:
        if base is not None and r is not base:
            print(f"speed-up {base['ms_per_step'] / r['ms_per_step']:.2f}x ({r['impl']} vs transformers)")
    for r in results:
        print(f"host time to issue a step: {r['impl']} {r['host_ms_per_step']:.1f} ms of {r['ms_per_step']:.1f}")
        if r.get("phases_ms"):
            print("  forward / backward: GPU {gpu_fwd:.1f} / {gpu_bwd:.1f} ms, host {host_fwd:.1f} / {host_bwd:.1f} ms"
                  .format(**r["phases_ms"]))
    for r in results:
        if "sync_sites" in r:
            print(f"\n== host-GPU synchronisations: {r['impl']} (one step; count, innermost frames) ==")
            for site, n in r["sync_sites"]:
                print(f"{n:5d}  {site}")
        if "profile" in r:
            print(f"\n== profile: {r['impl']} (one step, ops by self device time) ==\n{r['profile']}")
    with_categories = [r for r in results if "profile_categories" in r]
    if with_categories:
        print("\n== GPU time of one step by kernel category (ms) ==")
        cats = list(dict.fromkeys(c for r in with_categories for c in r["profile_categories"]))
        print(f"{'category':18s}" + "".join(f"{r['impl']:>16s}" for r in with_categories))
        for c in cats + ["total"]:
            vals = [sum(v["ms"] for v in r["profile_categories"].values()) if c == "total"
                    else r["profile_categories"].get(c, {"ms": 0.0})["ms"] for r in with_categories]
            print(f"{c:18s}" + "".join(f"{v:16.1f}" for v in vals))
        if all("gpu_busy" in r for r in with_categories):
            rows = (("GPU busy (union)", "busy_ms"), ("GPU span", "span_ms"), ("GPU idle", "idle_ms"))
            for label, key in rows:
                print(f"{label:18s}" + "".join(f"{r['gpu_busy'][key]:16.1f}" for r in with_categories))
            print("(GPU busy: union of the profiled step's kernel/copy intervals; span: its first start to last end;"
                  " GPU idle: the timed median step minus GPU busy)")
        for r in with_categories:
            print(f"\n-- {r['impl']}: top kernels of each category (ms, calls) --")
            for c, v in r["profile_categories"].items():
                for name, ms, calls in v["top"][:4]:
                    print(f"{c:18s} {ms:8.2f} {calls:6d}  {name[:100]}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
