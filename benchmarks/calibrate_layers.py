"""Calibration of the layout planner: the forward + backward time and peak memory of one GLM-5 decoder layer at full
width, measured on this GPU, written as the table megatron_glm5/planning/calibration.py reads.

    python benchmarks/calibrate_layers.py [--tokens 2048 4096 8192] [--local-experts 8 32 256] [--attn triton]
        [--out megatron_glm5/planning/calibration_h200.json]

A layer's cost is the difference between a model of two such layers and a model of one (the embedding, the LM
head and the loss cancel): for "dense" two dense-MLP layers, for "moe" two MoE layers with L routed experts
(the local experts of a rank at EP = 256 / L), top-min(8, L), so that the grouped GEMMs see the rank's
tokens x 8 routed rows spread over L experts as at that layout (dispatch is a local permutation: EP 1).  Both
layers have their own indexer (IndexShare's shared layers are not measured separately).  Each configuration runs
with and without full recompute (the same model; megatron-core's full uniform recompute, one layer per unit),
one sequence of T tokens per step, bf16, the DSA sparse stage with the indexer KL loss at 1e-3.  Timing: CUDA
events around forward + backward after --warmup steps, the median of --steps; fresh random token ids per step;
gradients dropped between steps, outside the timed region.  Memory: the step's peak allocation above what was
allocated before it (weights), per layer (two-layer minus one-layer): the layer's activations at their peak plus
its bf16 weight gradients (``layer_param_bytes`` says how much of it those are).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform as pyplatform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_glm5.config import GLM5Config  # noqa: E402


def layer_config(preset: str, kind: str, layers: int, local_experts: int) -> GLM5Config:
    cfg = GLM5Config.from_preset(preset)
    changes = dict(num_hidden_layers=layers, num_nextn_predict_layers=0,
                   first_k_dense_replace=layers if kind == "dense" else 0)
    if kind == "moe":
        changes.update(n_routed_experts=local_experts, num_experts_per_tok=min(cfg.num_experts_per_tok, local_experts))
    return cfg.replace(**changes)


def build(cfg: GLM5Config, attn: str, dtype, device):
    from megatron_glm5.model.model import build_model

    model = build_model(cfg, mtp=False, params_dtype=dtype, bf16=dtype == torch.bfloat16, dsa_backend=attn,
                        dsa_stage="sparse", dsa_indexer_loss_coeff=1e-3, fp32_router_and_indexer_weights=False,
                        recompute_method="uniform", recompute_num_layers=1)
    return model.to(device).train()


def set_recompute(model, on: bool) -> None:
    """Full uniform recompute on or off: GLM5TransformerBlock reads the config at every forward."""
    model.config.recompute_granularity = "full" if on else None


def measure(model, vocab: int, tokens: int, steps: int, warmup: int, device) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(tokens)
    times, peaks = [], []
    for i in range(warmup + steps):
        ids = torch.randint(1, vocab, (1, tokens + 1), generator=gen).to(device)
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        loss = model(ids[:, :-1], labels=ids[:, 1:]).float().mean()
        loss.backward()
        if device.type == "cuda":
            end.record()
            torch.cuda.synchronize()
            ms, peak = start.elapsed_time(end), torch.cuda.max_memory_allocated() - base
        else:  # a CPU smoke run: host clock, no allocator statistics
            ms, peak = (time.perf_counter() - t0) * 1e3, 0
        if i >= warmup:
            times.append(ms)
            peaks.append(peak)
    model.zero_grad(set_to_none=True)
    return {"ms": statistics.median(times), "ms_spread": max(times) - min(times), "peak": max(peaks)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="glm5.3")
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--local-experts", type=int, nargs="+", default=[8, 32, 256])
    p.add_argument("--kinds", nargs="+", default=["dense", "moe"], choices=("dense", "moe"))
    p.add_argument("--attn", default="triton")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None, help="the calibration JSON (default: print only)")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else pyplatform.processor() or "cpu"
    command = "python benchmarks/calibrate_layers.py " + " ".join(map(shlex.quote, sys.argv[1:] if argv is None
                                                                     else argv))

    def write():  # after every layer configuration: an interrupted run keeps what it measured
        if not a.out:
            return
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump({"date": datetime.date.today().isoformat(), "device": device_name, "command": command,
                       "torch": torch.__version__, "rows": rows}, f, indent=1)

    for kind in a.kinds:
        for local in (a.local_experts if kind == "moe" else [0]):
            per_depth = {}
            for depth in (1, 2):
                cfg = layer_config(a.preset, kind, depth, local)
                model = build(cfg, a.attn, dtype, device)
                for rc in (False, True):
                    set_recompute(model, rc)
                    for t in a.tokens:
                        per_depth[depth, rc, t] = measure(model, cfg.vocab_size, t, a.steps, a.warmup, device)
                layer_params = cfg.layer_parameters(0)
                del model
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            for rc in (False, True):
                for t in a.tokens:
                    one, two = per_depth[1, rc, t], per_depth[2, rc, t]
                    row = {"layer": kind, "local_experts": local if kind == "moe" else None, "tokens": t,
                           "recompute": rc, "fwd_bwd_ms": two["ms"] - one["ms"],
                           "peak_mib": (two["peak"] - one["peak"]) / 2 ** 20,
                           "layer_param_bytes": layer_params * (2 if dtype == torch.bfloat16 else 4),
                           "one_layer_model_ms": one["ms"], "two_layer_model_ms": two["ms"],
                           "spread_ms": max(one["ms_spread"], two["ms_spread"]),
                           "hidden": GLM5Config.from_preset(a.preset).hidden_size, "seq_length": t, "attn": a.attn}
                    rows.append(row)
                    print(f"{kind:5} L={row['local_experts'] or '-':>4} T={t:5} recompute={'on ' if rc else 'off'} "
                          f"layer {row['fwd_bwd_ms']:8.2f} ms (models {one['ms']:.1f} / {two['ms']:.1f}, spread "
                          f"{row['spread_ms']:.2f})  peak +{row['peak_mib']:8.0f} MiB", flush=True)
            write()
    if a.out:
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
