"""Parallel conversion (--workers) on a synthetic GLM-5 checkpoint of full-width tensors: wall time, MiB/s, peak
RSS per worker, and whether 1, 4 and 8 workers write bitwise-equal outputs (sha256 of every file, in 1 GiB
segments hashed in parallel). Prints one JSON object on stdout.

    python benchmarks/conversion_parallel.py --size-gb 20 --workers 1 4 8 --direction both --workdir /tmp/cpar

The synthetic checkpoint: GLM-5.3 widths (hidden 6144, vocab 154880, MLA, indexer), 4 layers (layer 0 dense), as
many routed experts of the real size per MoE layer as reach --size-gb; random bf16, fp32 router bias; 5 GB shards.
Disk: input + one output at a time (each output is hashed, then deleted; the export reads the last import's
output after the HF input is deleted), so about 2 x --size-gb.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from conversion_memory import hf_tensor_list, run_measured, synthetic_config  # noqa: E402

from megatron_glm5.conversion.safetensors_stream import SafetensorsShardWriter, plan_shards  # noqa: E402

SEGMENT = 2 ** 30
TOOLS = os.path.join(os.path.dirname(HERE), "tools")


def _hash_segment(args):
    path, start = args
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        left = SEGMENT
        while left:
            buf = f.read(min(left, 64 * 2 ** 20))
            if not buf:
                break
            h.update(buf)
            left -= len(buf)
    return h.hexdigest()


def hash_dir(directory: str, pool) -> dict:
    """{file: [sha256 of each 1 GiB segment]} for every file of ``directory`` (dot files included)."""
    jobs = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        size = os.path.getsize(path)
        jobs += [(name, (path, s)) for s in range(0, max(size, 1), SEGMENT)]
    digests = list(pool.map(_hash_segment, [j[1] for j in jobs]))
    out = {}
    for (name, _), d in zip(jobs, digests):
        out.setdefault(name, []).append(d)
    return out


def write_synthetic_fast(cfg, directory: str, seed: int = 0, block_bytes: int = 64 * 2 ** 20) -> int:
    """conversion_memory.write_synthetic's checkpoint, with data made fast: one 256 MiB random bf16 pool; each
    block is a window of it (offset from the block's index) XOR a per-block constant in the low mantissa bits
    (values stay finite), so no two blocks are alike and a misplaced block shows in the hashes."""
    os.makedirs(directory, exist_ok=True)
    tensors = hf_tensor_list(cfg)
    shards = plan_shards(tensors, 5 * 10 ** 9)
    gen = torch.Generator().manual_seed(seed)
    pool_elems = 128 * 2 ** 20
    pool = torch.randint(0, 0x3F80, (pool_elems,), dtype=torch.int16, generator=gen)
    pool ^= torch.randint(0, 2, (pool_elems,), dtype=torch.int16, generator=gen) << 15
    weight_map, index = {}, 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        w = SafetensorsShardWriter(os.path.join(directory, name), shard)
        for t in shard:
            rows = t.shape[0]
            step = max(1, block_bytes // max(1, t.nbytes // rows))
            for r0 in range(0, rows, step):
                shape = (min(rows, r0 + step) - r0,) + tuple(t.shape[1:])
                n = math.prod(shape)
                if t.dtype != torch.bfloat16:
                    w.write(torch.randn(shape, dtype=t.dtype, generator=gen))
                    continue
                start = (index * 7919 * 64) % (pool_elems - n + 1)
                w.write((pool[start:start + n] ^ ((index * 2654435761) & 0x7F)).view(torch.bfloat16).view(shape))
                index += 1
            weight_map[t.name] = name
        w.close(fsync=False)
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(t.nbytes for t in tensors)}, "weight_map": weight_map}, f)
    cfg.save_hf(directory)
    return sum(t.nbytes for t in tensors)


def experts_for(size_gb: float, layers: int) -> int:
    base = synthetic_config(layers, 8)
    expert = 3 * base.moe_intermediate_size * base.hidden_size * 2
    fixed = 5.0e9  # embedding + head (3.8 GB) + dense layer + attention of the MoE layers, roughly
    return max(8, math.ceil((size_gb * 1e9 - fixed) / ((layers - 1) * expert)))


def convert(direction: str, src: str, dst: str, workers: int) -> dict:
    if direction == "hf2mcore":
        cmd = [sys.executable, os.path.join(TOOLS, "convert_hf_to_megatron.py"), "--hf-dir", src, "--save", dst]
    else:
        cmd = [sys.executable, os.path.join(TOOLS, "convert_megatron_to_hf.py"), "--load", src, "--save", dst]
    cmd += ["--workers", str(workers), "--no-progress"]
    m = run_measured(cmd)
    s = m["summary"]
    return {"workers": workers, "wall_s": round(m["wall_s"], 2), "bytes": s["bytes"],
            "mib_per_s": round(s["bytes"] / 2 ** 20 / m["wall_s"], 1),
            "write_phase_mib_per_s": round(s["bytes"] / 2 ** 20 / max(s["write_seconds"], 1e-9), 1),
            "coordinator_peak_rss_gib": round(s["peak_rss_bytes"] / 2 ** 30, 3),
            "worker_peak_rss_gib": [round(p / 2 ** 30, 3) for p in s["worker_peak_rss_bytes"]],
            "command": " ".join(cmd)}


def run_direction(direction, src, out, workers, pool) -> tuple[list, bool]:
    rows, ref = [], None
    for i, w in enumerate(workers):
        if os.path.exists(out):
            shutil.rmtree(out)
        row = convert(direction, src, out, w)
        t0 = time.time()
        digest = hash_dir(out, pool)
        row["hash_s"] = round(time.time() - t0, 1)
        row["bitwise_equal_to_first"] = True if ref is None else digest == ref
        ref = ref or digest
        rows.append(row)
        print(json.dumps({"progress": direction, **row}), file=sys.stderr, flush=True)
    return rows, all(r["bitwise_equal_to_first"] for r in rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gb", type=float, default=20.0)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--direction", choices=("hf2mcore", "mcore2hf", "both"), default="both")
    p.add_argument("--workdir", default="/tmp/glm5_conversion_parallel")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints (default: deleted at the end)")
    args = p.parse_args(argv)
    t_all = time.time()
    hf, mc, back = (os.path.join(args.workdir, n) for n in ("hf", "mcore", "hf_out"))
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    experts = experts_for(args.size_gb, args.layers)
    cfg = synthetic_config(args.layers, experts)
    result = {"benchmark": "conversion_parallel", "date": datetime.date.today().isoformat(),
              "device": {"host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
                         "python": platform.python_version(),
                         "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
              "command": " ".join([sys.executable] + sys.argv), "layers": args.layers, "experts": experts}
    try:
        with concurrent.futures.ProcessPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
            t0 = time.time()
            result["checkpoint_bytes"] = write_synthetic_fast(cfg, hf)
            result["write_input_s"] = round(time.time() - t0, 1)
            if args.direction in ("hf2mcore", "both"):
                result["hf2mcore"], result["hf2mcore_bitwise_equal"] = run_direction("hf2mcore", hf, mc,
                                                                                      args.workers, pool)
            if args.direction in ("mcore2hf", "both"):
                if not os.path.exists(mc):
                    convert("hf2mcore", hf, mc, max(args.workers))
                shutil.rmtree(hf)  # disk: the export needs only the torch_dist input
                result["mcore2hf"], result["mcore2hf_bitwise_equal"] = run_direction("mcore2hf", mc, back,
                                                                                      args.workers, pool)
    finally:
        if not args.keep:
            shutil.rmtree(args.workdir, ignore_errors=True)
    result["total_s"] = round(time.time() - t_all, 1)
    print(json.dumps(result, indent=2))
    ok = all(result.get(k, True) for k in ("hf2mcore_bitwise_equal", "mcore2hf_bitwise_equal"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
