"""FP8 export at full width checked against transformers' own FP8 path (issue 17): a random GLM-5.3-width
transformers model (2 layers: a dense and a MoE layer, --experts routed experts; every matrix at its real shape, so
kv_a_proj_with_mqa [576, 6144] has its partial last scale block) saved in bf16, converted to our checkpoint, exported
with ``--dtype fp8`` and with ``--dtype bf16``; both exports loaded by transformers on the GPU (the FP8 one through its
fine-grained FP8 support: quantizer, FP8Linear / FP8Experts modules, weight_scale_inv, modules_to_not_convert, all
from the quantization_config we write) and run on the same random tokens. Prints JSON.

What it reports:
- transformers' loaded FP8 tensors (weights and scales, experts fused gate|up) against the export's bytes: bitwise;
- logits of the FP8 export against the bf16 export's (max-abs, relative L2, top-1 agreement), and against a control:
  the bf16 model holding the FP8 weights dequantised (w = q * scale_inv per 128x128 block), which isolates the
  FP8 GEMM's own error (activation quantisation) from the weights' rounding;
- our FP8 import (--keep-fp8) of the FP8 export, exported again: bitwise equal to the FP8 export.

The GEMM: transformers (5.17 on the H200) takes its FP8 matmul from the hub kernel ``kernels-community/finegrained-fp8``
through the ``kernels`` package (0.16), downloaded at first use. Offline, ``--kernel-dir`` points the ``kernels``
package at a local copy of that kernel repo (its ``LOCAL_KERNELS`` override; ``HF_HUB_OFFLINE=1``), so transformers'
own code path runs unchanged with the real Triton kernel. ``--matmul torch`` instead installs a torch reference of
the kernel's three entry points (dequantise the weight with its 128x128 blocks, partial last blocks included, then
matmul in the activations' dtype): the only thing replaced in transformers is then the GEMM. ``kernel,torch`` runs
both and compares them. ``--autotune-configs 1`` keeps one Triton config per kernel (warps 4, stages 3): the same
kernel and numerics, without minutes of autotuning at every new shape.

    python benchmarks/fp8_export_check.py [--experts 32] [--tokens 256] [--workdir /tmp/fp8x]
        [--kernel-src DIR | --kernel-dir DIR] [--matmul kernel|torch|kernel,torch] [--autotune-configs 1]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import traceback

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
# the repository root on the path, not this folder (a benchmark module here must not shadow an installed package)
sys.path[:] = [os.path.dirname(_HERE)] + [q for q in sys.path if os.path.abspath(q or ".") != _HERE]

KERNEL_REPO = "kernels-community/finegrained-fp8"


def _read(directory) -> dict:
    from megatron_glm5.conversion.safetensors_io import HFCheckpointReader

    reader = HFCheckpointReader(directory)
    return {k: reader.get(k) for k in reader.keys()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


# ---------------------------------------------------------------- the GEMM: local hub kernel or a torch reference
def use_local_kernel(kernel_dir: str) -> None:
    """Point the ``kernels`` package at a local copy of the hub kernel (set before transformers is imported)."""
    os.environ["LOCAL_KERNELS"] = f"{KERNEL_REPO}={os.path.abspath(kernel_dir)}"
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_DISABLE_DEEPGEMM_LINEAR"] = "1"  # DeepGEMM is another hub kernel; not here


_OPS_PY = """import torch

NAMESPACE = "_finegrained_fp8_local"
ops = getattr(torch.ops, NAMESPACE)


def add_op_namespace_prefix(op_name: str) -> str:
    return f"{NAMESPACE}::{op_name}"
"""
_METADATA = {"name": "finegrained-fp8", "id": "_finegrained_fp8_local", "version": 4, "license": "Apache-2.0",
             "python-depends": [], "backend": {"type": "cuda"}}


def prepare_local_kernel(src: str, dst: str) -> str:
    """A local kernel repo for ``kernels.get_local_kernel`` from the kernel's Python sources (``src``: the
    ``finegrained-fp8/torch-ext/finegrained_fp8`` folder of github.com/huggingface/kernels-community): the sources in
    ``build/torch-cuda`` plus the two files the hub build adds, ``_ops.py`` (the op namespace) and ``metadata.json``."""
    variant = os.path.join(dst, "build", "torch-cuda")
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, variant)
    with open(os.path.join(variant, "_ops.py"), "w") as f:
        f.write(_OPS_PY)
    with open(os.path.join(variant, "metadata.json"), "w") as f:
        json.dump(_METADATA, f)
    return dst


def _ref_linear(a, w, s, out_dtype):
    from megatron_glm5.fp8.blocks import dequantize_blocks

    return torch.nn.functional.linear(a, dequantize_blocks(w, s, a.dtype)).to(out_dtype or a.dtype)


def torch_reference_kernel():
    """transformers' FineGrainedFP8 bundle with the three entry points done in torch (weights dequantised)."""
    from transformers.integrations import finegrained_fp8 as tf8

    def matmul(a, w, s, block_size=None, output_dtype=None, activation_scale=None):
        return _ref_linear(a, w, s, output_dtype)

    def batched_matmul(a, w, s, block_size=None, expert_ids=None):
        out = torch.zeros(a.shape[0], w.shape[1], dtype=a.dtype, device=a.device)
        for e in torch.unique(expert_ids).tolist():
            if e < w.shape[0]:
                rows = expert_ids == e
                out[rows] = _ref_linear(a[rows], w[e], s[e], a.dtype)
        return out

    def grouped_matmul(a, w, s, offsets=None, tokens_per_expert=None, block_size=None):
        out = torch.zeros(a.shape[0], w.shape[1], dtype=a.dtype, device=a.device)
        start = 0
        for e, n in enumerate(int(x) for x in tokens_per_expert.tolist()):
            if n:
                out[start:start + n] = _ref_linear(a[start:start + n], w[e], s[e], a.dtype)
            start += n
        return out

    return tf8.FineGrainedFP8(matmul=matmul, batched_matmul=batched_matmul, grouped_matmul=grouped_matmul)


def set_gemm(mode: str, autotune_configs: int) -> dict:
    """Install the GEMM transformers' FP8 modules call; returns what was installed."""
    from transformers.integrations import finegrained_fp8 as tf8

    tf8._FINEGRAINED_FP8 = None
    if mode == "torch":
        tf8._FINEGRAINED_FP8 = torch_reference_kernel()
        return {"gemm": "torch reference (dequantised weight, then matmul)"}
    bundle = tf8.load_finegrained_fp8_kernel()  # transformers' own loader: kernels.get_kernel -> LOCAL_KERNELS
    module = sys.modules[bundle.matmul.__module__]
    trimmed = 0
    if autotune_configs:
        from triton.runtime.autotuner import Autotuner

        for name, mod in list(sys.modules.items()):
            if not name.startswith(module.__name__.split(".")[0]):
                continue
            for obj in vars(mod).values():
                if isinstance(obj, Autotuner) and len(obj.configs) > autotune_configs:
                    pick = [c for c in obj.configs if c.num_warps == 4 and c.num_stages == 3] or obj.configs
                    obj.configs = pick[:autotune_configs]
                    trimmed += 1
    return {"gemm": "transformers finegrained-fp8 Triton kernel", "kernel_module": module.__name__,
            "kernel_file": getattr(module, "__file__", None), "autotuners_trimmed": trimmed}


# ---------------------------------------------------------------- the export's tensors as transformers holds them
def expected_model_tensor(name: str, files: dict, n_experts: int):
    """The tensor transformers should hold at model parameter ``name`` (FP8 model), built from the export's files;
    None where the parameter is not an FP8 weight or scale."""
    suffix = "_scale_inv" if name.endswith("_scale_inv") else ""
    base = name[: -len(suffix)] if suffix else name
    if ".mlp.experts." in base:  # fused [E, 2I, H] gate|up and [E, H, I] down
        prefix, proj = base.rsplit(".", 1)
        fsuf = "weight_scale_inv" if suffix else "weight"
        if proj == "gate_up_proj":
            return torch.stack([torch.cat([files[f"{prefix}.{e}.gate_proj.{fsuf}"],
                                           files[f"{prefix}.{e}.up_proj.{fsuf}"]]) for e in range(n_experts)])
        if proj == "down_proj":
            return torch.stack([files[f"{prefix}.{e}.down_proj.{fsuf}"] for e in range(n_experts)])
        return None
    if name.endswith(".weight_scale_inv"):
        return files.get(name)
    if name.endswith(".weight") and name[: -len("weight")] + "weight_scale_inv" in files:
        return files[name]
    return None


def dequantised_state(model, files: dict, n_experts: int) -> dict:
    """For the bf16 model: each FP8-exported weight replaced by q * scale_inv (per 128x128 block), in bf16."""
    from megatron_glm5.fp8.blocks import dequantize_blocks

    out = {}
    for name, p in model.named_parameters():
        q = expected_model_tensor(name, files, n_experts)
        if q is None or name.endswith("_scale_inv"):
            continue
        s = expected_model_tensor(name + "_scale_inv" if ".mlp.experts." in name else
                                  name[: -len("weight")] + "weight_scale_inv", files, n_experts)
        if s is None:
            continue
        if ".mlp.experts." in name and name.endswith("gate_up_proj"):  # each half has its own block grid
            prefix = name.rsplit(".", 1)[0]
            w = torch.stack([torch.cat([
                dequantize_blocks(files[f"{prefix}.{e}.{h}.weight"], files[f"{prefix}.{e}.{h}.weight_scale_inv"])
                for h in ("gate_proj", "up_proj")]) for e in range(n_experts)])
        else:
            w = dequantize_blocks(q, s)
        out[name] = w.to(p.dtype)
    return out


def w8a8_emulated(a: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """What a dynamic W8A8 block GEMM computes, in torch: the activations quantised to e4m3 per token and 128-column
    block (scale amax / 448), times the dequantised weight, in fp32."""
    from megatron_glm5.fp8.blocks import dequantize_blocks

    m, k = a.shape
    blocks = -(-k // 128)
    pad = torch.nn.functional.pad(a.float(), (0, blocks * 128 - k)).view(m, blocks, 128)
    scale = (pad.abs().amax(-1, keepdim=True) / 448.0).clamp(min=1e-12)
    a_q = ((pad / scale).to(torch.float8_e4m3fn).float() * scale).view(m, -1)[:, :k]
    return a_q @ dequantize_blocks(w, s, torch.float32).T


def linear_check(model, tokens: int) -> dict:
    """Each FP8Linear of the loaded model on random activations: transformers' GEMM (the kernel installed) against the
    W8A8 emulation and against the weight-only reference (relative L2)."""
    out = {}
    gen = torch.Generator(device="cpu").manual_seed(2)
    for name, m in model.named_modules():
        if type(m).__name__ != "FP8Linear":
            continue
        a = torch.randn(tokens, m.in_features, generator=gen).to(m.weight.device, torch.bfloat16)
        with torch.no_grad():
            got = m(a).float()
        emu = w8a8_emulated(a, m.weight, m.weight_scale_inv)
        ref = _ref_linear(a, m.weight, m.weight_scale_inv, torch.float32).float()
        out[name.replace("model.layers.", "L")] = {
            "shape": [m.out_features, m.in_features],
            "vs_w8a8_emulation": round(float((got - emu).norm() / emu.norm()), 6),
            "vs_weight_only": round(float((got - ref).norm() / ref.norm()), 6)}
    worst = max(out.values(), key=lambda v: v["vs_w8a8_emulation"]) if out else None
    return {"modules": out, "worst_vs_w8a8_emulation": worst}


def _stage(name: str, times: dict, t: float) -> None:
    times[name] = round(time.time() - t, 1)
    print(f"fp8_export_check: {name} {times[name]} s", file=sys.stderr, flush=True)


def compare(got: torch.Tensor, ref: torch.Tensor) -> dict:
    return {"max_abs": float((got - ref).abs().max()), "ref_max_abs": float(ref.abs().max()),
            "rel_l2": float((got - ref).norm() / ref.norm()),
            "top1_agreement": float((got.argmax(-1) == ref.argmax(-1)).float().mean())}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--workdir", default="/tmp/fp8x")
    p.add_argument("--kernel-dir", default=None, help="local copy of kernels-community/finegrained-fp8")
    p.add_argument("--kernel-src", default=None,
                   help="the kernel's torch-ext/finegrained_fp8 sources: made into a local copy (see --kernel-dir)")
    p.add_argument("--matmul", default="kernel", help="kernel, torch, or kernel,torch")
    p.add_argument("--autotune-configs", type=int, default=1, help="Triton configs kept per kernel; 0: all")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--preset", default="glm5.3", help="model width (a GLM5Config preset; tiny: a CPU smoke run)")
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    modes = args.matmul.split(",")
    if args.kernel_src:
        args.kernel_dir = prepare_local_kernel(args.kernel_src, args.workdir.rstrip("/") + "_kernel")
    if args.kernel_dir:
        use_local_kernel(args.kernel_dir)
    import transformers
    from transformers import AutoModelForCausalLM, GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    from megatron_glm5.config import GLM5Config
    from megatron_glm5.conversion.convert import convert_hf_to_megatron, convert_megatron_to_hf

    t0 = time.time()
    times = {}
    cfg = GLM5Config.from_preset(args.preset)
    changes = dict(num_hidden_layers=2, first_k_dense_replace=1, num_nextn_predict_layers=0,
                   n_routed_experts=args.experts)
    if cfg.shared_layers:
        changes["indexer_types"] = ["full", "shared"]
    cfg = cfg.replace(**changes)
    shutil.rmtree(args.workdir, ignore_errors=True)
    d = {k: os.path.join(args.workdir, k) for k in ("hf", "ckpt", "fp8", "bf16", "ckpt8", "fp8_again")}
    torch.manual_seed(0)
    with torch.device(args.device):
        hf = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**cfg.to_hf())).to(torch.bfloat16)
    hf.save_pretrained(d["hf"])
    del hf
    _stage("build_and_save_hf", times, t0)
    t = time.time()
    convert_hf_to_megatron(d["hf"], d["ckpt"], progress=False, workers=8)
    convert_megatron_to_hf(d["ckpt"], d["fp8"], dtype="fp8", mtp=False, progress=False, workers=8)
    convert_megatron_to_hf(d["ckpt"], d["bf16"], dtype="bf16", mtp=False, progress=False, workers=8)
    convert_hf_to_megatron(d["fp8"], d["ckpt8"], keep_fp8=True, progress=False, workers=8)
    convert_megatron_to_hf(d["ckpt8"], d["fp8_again"], mtp=False, progress=False, workers=8)
    _stage("conversions", times, t)
    files, again = _read(d["fp8"]), _read(d["fp8_again"])
    requantised = sorted(k for k in files if ".indexer.wq_b." in k or ".indexer.wk." in k)  # bf16 in our model
    mismatched = sorted(k for k in files if k not in requantised
                        and (k not in again or not torch.equal(_bits(files[k]), _bits(again[k]))))
    import_bitwise = {"tensors": len(files), "bitwise": len(files) - len(requantised) - len(mismatched),
                      "mismatched": mismatched[:10], "requantised_indexer": len(requantised),
                      "same_names": sorted(files) == sorted(again)}
    del again
    with open(os.path.join(d["fp8"], "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    kv_a = "model.layers.0.self_attn.kv_a_proj_with_mqa"
    n_fp8 = sum(v.dtype == torch.float8_e4m3fn for v in files.values())

    ids = torch.randint(0, cfg.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(1)).to(args.device)
    results = {}
    t = time.time()
    model = AutoModelForCausalLM.from_pretrained(d["bf16"], dtype=torch.bfloat16, device_map=args.device).eval()
    with torch.no_grad():
        ref = model(ids).logits.float()
        model.load_state_dict(dequantised_state(model, files, args.experts), strict=False)
        control = model(ids).logits.float()
    del model
    _stage("bf16_load_and_forward", times, t)
    results["dequantised_weights_vs_bf16"] = compare(control, ref)

    t = time.time()
    model = AutoModelForCausalLM.from_pretrained(d["fp8"], dtype=torch.bfloat16, device_map=args.device).eval()
    _stage("fp8_load", times, t)
    kinds = {}
    for name, m in model.named_modules():
        kinds.setdefault(type(m).__name__, []).append(name)
    fp8_kinds = {k: len(v) for k, v in kinds.items() if "fp8" in k.lower()}
    params = dict(model.named_parameters())
    checked = bad = 0
    bad_names = []
    for name, prm in params.items():
        want = expected_model_tensor(name, files, args.experts)
        if want is None:
            continue
        checked += 1
        if prm.dtype != want.dtype or prm.shape != want.shape or not torch.equal(_bits(prm.detach().cpu()),
                                                                                  _bits(want)):
            bad += 1
            bad_names.append(name)
    kept = {n: str(params[n].dtype) for n in params if n.endswith(("lm_head.weight", "embed_tokens.weight",
                                                                    "mlp.gate.weight", "e_score_correction_bias",
                                                                    "indexer.weights_proj.weight"))}
    loading = {"transformers": transformers.__version__, "fp8_module_types": fp8_kinds,
               "kv_a_proj_with_mqa": {"module": type(model.get_submodule(kv_a)).__name__,
                                      "weight": str(params[kv_a + ".weight"].dtype),
                                      "weight_scale_inv": list(params[kv_a + ".weight_scale_inv"].shape)
                                      if kv_a + ".weight_scale_inv" in params else None},
               "fp8_params_checked": checked, "fp8_params_bitwise": checked - bad, "fp8_params_differing":
                   bad_names[:10], "kept_high_precision": kept}
    for mode in modes:
        entry = {}
        try:
            t = time.time()
            entry.update(set_gemm(mode, args.autotune_configs))
            with torch.no_grad():
                got = model(ids).logits.float()
                if args.device == "cuda":
                    torch.cuda.synchronize()
            _stage(f"forward_{mode}", times, t)
            entry["vs_bf16_export"] = compare(got, ref)
            entry["vs_dequantised_weights"] = compare(got, control)
            entry["fp8_linears"] = linear_check(model, args.tokens)
            results[mode] = entry
            results.setdefault("_logits", {})[mode] = got
        except Exception as e:  # a GEMM that cannot run here: say which and why, keep the other modes
            entry["error"] = f"{type(e).__name__}: {e}"[:600]
            entry["traceback_tail"] = traceback.format_exc()[-1500:]
            print(entry["traceback_tail"], file=sys.stderr, flush=True)
            results[mode] = entry
    got_logits = results.pop("_logits", {})
    if {"kernel", "torch"} <= set(got_logits):
        results["kernel_vs_torch_reference"] = compare(got_logits["kernel"], got_logits["torch"])
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    out = {"benchmark": "fp8_export_check", "date": time.strftime("%Y-%m-%d"), "device": device,
           "command": " ".join(["python", "benchmarks/fp8_export_check.py", *(argv or sys.argv[1:])]),
           "torch": torch.__version__, "model": {"preset": args.preset, "layers": 2, "routed_experts": args.experts,
                                                  "tokens": args.tokens},
           "fp8_tensors_in_export": n_fp8, "quantization_config": qc, "transformers_loading": loading,
           "logits": results, "keep_fp8_import_then_export": import_bitwise, "seconds": times,
           "total_s": round(time.time() - t0, 1)}
    text = json.dumps(out)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    shutil.rmtree(args.workdir, ignore_errors=True)
    return out


if __name__ == "__main__":
    main()
