"""Peak host and GPU memory of building GLM-5 with the frozen FP8 base (--base-precision fp8) vs bf16, and of loading
a synthetic FP8 checkpoint of it: the model is built without a bf16 copy of its large matrices, and loading keeps
host and GPU memory bounded (issue 15, "Must show").

Each measurement runs in a fresh process (peak RSS = the process's VmHWM; peak GPU = torch.cuda.max_memory_allocated):
  build bf16   build_model(..., base_precision="bf16") (the model's own init)
  build fp8    build_model(..., base_precision="fp8")  (FP8 tensors allocated directly, initialised weight by weight)
  save fp8     the fp8 model saved as a torch_dist checkpoint (the synthetic checkpoint; skipped with --no-load)
  load fp8     a fresh fp8 model (no init) loading that checkpoint with megatron-core dist_checkpointing

Defaults: 2 layers at GLM-5 width (hidden 6144, 64 heads, MLA ranks 2048/512, layer 0 dense 12288, layer 1 MoE with
all 256 experts of 2048 + 1 shared), GLM-5's vocabulary, no MTP. On the H200:
  python benchmarks/fp8_build_memory.py --out fp8_build_memory.json
On CPU (a smaller check): python benchmarks/fp8_build_memory.py --device cpu --experts 16 --vocab 1024
Prints one JSON object (figures, device, command).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _config(opts):
    from megatron_glm5.config import GLM5Config

    raw = GLM5Config.from_preset("glm5").to_hf()
    raw.update(num_hidden_layers=2, first_k_dense_replace=1, num_nextn_predict_layers=0, n_routed_experts=opts.experts)
    if opts.vocab:  # a smaller vocabulary: the special token ids of the real one do not fit
        raw.update(vocab_size=opts.vocab, pad_token_id=0, eos_token_id=0, bos_token_id=None)
    raw.pop("indexer_types", None)
    raw.pop("mlp_layer_types", None)
    return GLM5Config.from_hf(raw)


def _phase(opts) -> dict:
    import torch

    from megatron_glm5 import platform
    from megatron_glm5.model.model import build_model

    cuda = opts.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    platform.initialize_model_parallel()
    kw = dict(mtp=False, params_dtype=torch.bfloat16, bf16=True, use_cpu_initialization=not cuda,
              perform_initialization=opts.phase != "load")
    t0 = time.time()
    model = build_model(_config(opts), base_precision=opts.precision, **kw)
    if cuda:
        torch.cuda.synchronize()
    out = {"build_seconds": time.time() - t0}
    tensors = [t for t in model.state_dict().values() if torch.is_tensor(t)]
    out["model_bytes"] = sum(t.numel() * t.element_size() for t in tensors)
    out["fp8_bytes"] = sum(t.numel() for t in tensors if t.dtype == torch.float8_e4m3fn)
    if opts.phase in ("save", "load"):
        import queue

        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        filesystem_async._results_queue = queue.Queue()
        t0 = time.time()
        if opts.phase == "save":
            dist_checkpointing.save(model.sharded_state_dict(), opts.ckpt)
        else:
            model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), opts.ckpt), strict=False)
        if cuda:
            torch.cuda.synchronize()
        out[f"{opts.phase}_seconds"] = time.time() - t0
    out["peak_rss_bytes"] = _peak_rss()
    if cuda:
        out["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: GLM-5's 154880)")
    p.add_argument("--no-load", action="store_true", help="only the two builds (no synthetic checkpoint on disk)")
    p.add_argument("--dir", default=None, help="where the synthetic checkpoint goes (default: a temporary dir)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    p.add_argument("--precision", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    opts = p.parse_args()
    if opts.phase:  # one measurement, in its own process
        print("RESULT " + json.dumps(_phase(opts)), flush=True)
        return
    base = [sys.executable, os.path.abspath(__file__), "--device", opts.device, "--experts", str(opts.experts)]
    if opts.vocab:
        base += ["--vocab", str(opts.vocab)]
    work = opts.dir or tempfile.mkdtemp(prefix="fp8_build_memory_")
    ckpt = os.path.join(work, "ckpt")
    runs = [("build_bf16", "build", "bf16"), ("build_fp8", "build", "fp8")]
    if not opts.no_load:
        runs += [("save_fp8", "save", "fp8"), ("load_fp8", "load", "fp8")]
    results = {}
    try:
        for name, phase, precision in runs:
            if phase == "save":
                os.makedirs(ckpt, exist_ok=True)
            proc = subprocess.run(base + ["--phase", phase, "--precision", precision, "--ckpt", ckpt],
                                  capture_output=True, text=True, env=dict(os.environ, PYTHONWARNINGS="ignore"))
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if proc.returncode or line is None:
                results[name] = {"error": (proc.stderr or proc.stdout)[-2000:]}
                break
            results[name] = json.loads(line[len("RESULT "):])
        if os.path.isdir(ckpt):
            results["checkpoint_bytes"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ckpt)
                                              for f in fs)
    finally:
        if not opts.dir:
            shutil.rmtree(work, ignore_errors=True)
    device = "cpu"
    if opts.device == "cuda":
        import torch
        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cuda (none visible)"
    report = {"benchmark": "fp8_build_memory", "date": time.strftime("%Y-%m-%d"), "device": device,
              "command": " ".join(["python", "benchmarks/fp8_build_memory.py"] + sys.argv[1:]),
              "model": {"layers": 2, "hidden": 6144, "routed_experts": opts.experts, "vocab": opts.vocab or 154880},
              "results": results}
    text = json.dumps(report, indent=2)
    print(text)
    if opts.out:
        with open(opts.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
