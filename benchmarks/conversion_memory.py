#!/usr/bin/env python
"""Peak memory and throughput of the checkpoint converters on synthetic GLM-5 checkpoints of real widths.

    python benchmarks/conversion_memory.py --layers 2 4 --experts 16 --json /tmp/conversion_memory.json

For each layer count L: writes a random HF checkpoint (GLM-5.3 widths: hidden 6144, vocab 154880, MLA, indexer;
layer 0 dense, layers 1.. MoE with ``--experts`` routed experts of the real 2048 x 6144 size, bf16, router bias
fp32), converts it with tools/convert_hf_to_megatron.py and back with tools/convert_megatron_to_hf.py (each in its
own process: peak RSS is that process's VmHWM), checks the round trip is bitwise identical, and
deletes everything. Prints a table and writes JSON. Needs about 3x the checkpoint size free under --workdir.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from megatron_glm5.config import GLM5Config  # noqa: E402
from megatron_glm5.conversion.hf_mapping import conversion_plan, hf_shapes_from_mcore  # noqa: E402
from megatron_glm5.conversion.safetensors_stream import (  # noqa: E402
    OutTensor,
    SafetensorsShardWriter,
    SafetensorsSource,
    plan_shards,
)

GiB = 2 ** 30


def synthetic_config(layers: int, experts: int) -> GLM5Config:
    cfg = GLM5Config.from_preset("glm5.3")
    return cfg.replace(num_hidden_layers=layers, first_k_dense_replace=1, n_routed_experts=experts,
                       num_nextn_predict_layers=0)


def hf_tensor_list(cfg: GLM5Config) -> list[OutTensor]:
    from megatron_glm5.conversion.convert import megatron_checkpoint_spec

    spec = megatron_checkpoint_spec(cfg, mtp=False)
    out = []
    for row in conversion_plan(cfg, include_mtp=False):
        shapes = hf_shapes_from_mcore(row, spec.tensors[row.mcore].global_shape)
        dtype = torch.float32 if row.mcore.endswith("router.expert_bias") else torch.bfloat16
        out += [OutTensor(k, dtype, tuple(s)) for k, s in zip(row.hf, shapes)]
    return out


def _random_block(shape, dtype, gen) -> torch.Tensor:
    if dtype == torch.bfloat16:  # random finite bf16 bit patterns with |x| < 1, cheaply
        bits = torch.randint(0, 0x3F80, shape, dtype=torch.int16, generator=gen)
        bits ^= torch.randint(0, 2, shape, dtype=torch.int16, generator=gen) << 15
        return bits.view(torch.bfloat16)
    return torch.randn(shape, dtype=dtype, generator=gen)


def write_synthetic(cfg: GLM5Config, directory: str, seed: int = 0, block_bytes: int = 128 * 2 ** 20) -> int:
    os.makedirs(directory, exist_ok=True)
    tensors = hf_tensor_list(cfg)
    shards = plan_shards(tensors, 5 * 10 ** 9)
    gen = torch.Generator().manual_seed(seed)
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        w = SafetensorsShardWriter(os.path.join(directory, name), shard)
        for t in shard:
            rows = t.shape[0]
            step = max(1, block_bytes // max(1, t.nbytes // rows))
            for r0 in range(0, rows, step):
                w.write(_random_block((min(rows, r0 + step) - r0,) + t.shape[1:], t.dtype, gen))
            weight_map[t.name] = name
        w.close(fsync=False)
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(t.nbytes for t in tensors)}, "weight_map": weight_map}, f)
    cfg.save_hf(directory)
    return sum(t.nbytes for t in tensors)


def run_measured(cmd: list[str]) -> dict:
    """Run a converter; return its wall time, its peak RSS and its summary line.

    The peak is the converter's own VmHWM (in its summary line): the ru_maxrss of a child would include this (large)
    benchmark process, which it was forked from before exec."""
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    summary = next(json.loads(line[len("summary "):]) for line in proc.stdout.splitlines()
                   if line.startswith("summary "))
    return {"wall_s": wall, "peak_rss_bytes": summary["peak_rss_bytes"], "summary": summary}


def bitwise_equal_dirs(a: str, b: str) -> bool:
    sa, sb = SafetensorsSource(a), SafetensorsSource(b)
    try:
        if set(sa.keys()) != set(sb.keys()):
            return False
        for k in sa.keys():
            ia, ib = sa.info(k), sb.info(k)
            if ia.dtype_name != ib.dtype_name or ia.shape != ib.shape:
                return False
            rows = ia.shape[0] if ia.shape else 1
            step = max(1, (256 * 2 ** 20) // max(1, ia.row_bytes))
            for r0 in range(0, rows, step):
                r1 = min(rows, r0 + step)
                if not torch.equal(sa.read_rows(k, r0, r1).view(torch.uint8), sb.read_rows(k, r0, r1).view(torch.uint8)):
                    return False
        return True
    finally:
        sa.close()
        sb.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    p.add_argument("--experts", type=int, default=16, help="routed experts per MoE layer (real size each)")
    p.add_argument("--workdir", default="/tmp/glm5_conversion_bench")
    p.add_argument("--json", default="/tmp/conversion_memory.json")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints")
    args = p.parse_args(argv)
    py = sys.executable
    results = []
    for layers in args.layers:
        cfg = synthetic_config(layers, args.experts)
        work = os.path.join(args.workdir, f"L{layers}")
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
        hf_in, mc, hf_out = (os.path.join(work, n) for n in ("hf", "torch_dist", "hf_out"))
        try:
            t0 = time.time()
            size = write_synthetic(cfg, hf_in)
            gen_s = time.time() - t0
            free = shutil.disk_usage(work).free
            if free < 2.2 * size:
                raise SystemExit(f"{work}: {free / GiB:.1f} GiB free, need about {2.2 * size / GiB:.1f} GiB more")
            imp = run_measured([py, os.path.join(ROOT, "tools", "convert_hf_to_megatron.py"), "--hf-dir", hf_in,
                                "--save", mc, "--no-progress"])
            exp = run_measured([py, os.path.join(ROOT, "tools", "convert_megatron_to_hf.py"), "--load", mc,
                                "--save", hf_out, "--no-progress"])
            same = bitwise_equal_dirs(hf_in, hf_out)
        finally:
            if not args.keep:
                shutil.rmtree(work, ignore_errors=True)
        h, i = cfg.hidden_size, cfg.moe_intermediate_size
        expert_group = args.experts * 2 * i * h * 2  # one MoE layer's stacked gate+up experts (weight1), bf16
        bound = 2 * expert_group + GiB
        row = {"layers": layers, "experts": args.experts, "checkpoint_bytes": size, "generate_s": gen_s,
               "largest_expert_group_bytes": expert_group, "rss_bound_bytes": bound, "bitwise_round_trip": same}
        for name, m in (("hf_to_megatron", imp), ("megatron_to_hf", exp)):
            row[name] = {"wall_s": m["wall_s"], "peak_rss_bytes": m["peak_rss_bytes"],
                         "convert_s": m["summary"].get("seconds"),
                         "stream_s": m["summary"].get("write_seconds"),
                         "mb_per_s_wall": size / 2 ** 20 / m["wall_s"],
                         "mb_per_s_stream": size / 2 ** 20 / m["summary"]["write_seconds"],
                         "under_bound": m["peak_rss_bytes"] < bound}
        results.append(row)
        print(f"L={layers}: done ({size / GiB:.2f} GiB)", flush=True)
    header = ("| layers | checkpoint | direction | peak RSS | bound 2x experts+1GiB | process wall | MiB/s (wall) | "
              "MiB/s (streaming phase) | bitwise |")
    print(header)
    print("|" + "---|" * 9)
    for r in results:
        for name in ("hf_to_megatron", "megatron_to_hf"):
            m = r[name]
            print(f"| {r['layers']} | {r['checkpoint_bytes'] / GiB:.2f} GiB | {name} | "
                  f"{m['peak_rss_bytes'] / GiB:.2f} GiB | {r['rss_bound_bytes'] / GiB:.2f} GiB | {m['wall_s']:.1f} s | "
                  f"{m['mb_per_s_wall']:.0f} | {m['mb_per_s_stream']:.0f} | {r['bitwise_round_trip']} |")
    record = {"date": datetime.date.today().isoformat(), "machine": f"{platform.node()} ({os.cpu_count()} CPUs)",
              "torch": torch.__version__, "command": " ".join([os.path.basename(sys.argv[0])] + (argv or sys.argv[1:])),
              "results": results}
    with open(args.json, "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {args.json}")
    ok = all(r["bitwise_round_trip"] and r[n]["under_bound"] for r in results for n in ("hf_to_megatron",
                                                                                          "megatron_to_hf"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
