"""Decode benchmark: prefill + incremental decoding with GLM-5's cache (megatron_glm5/generation) on a proxy model.

    python benchmarks/decode.py [--preset glm5.3 --layers 2 --dense 1 --prompt-len 4096 --new-tokens 128
                                 --batch 1,8 --attn torch,triton] [--json out.json]

Default model: GLM-5.3 width, 2 layers (1 dense + 1 MoE with all 256 experts; layer 1 a full indexer, layer 2 an
IndexShare layer as in GLM-5.3), no MTP, random weights, bf16, on one GPU. Per attention backend and batch size:
prefill of ``--prompt-len`` random tokens per row (timed), then ``--new-tokens`` greedy steps (timed, CUDA
synchronised per step), tokens/s = batch x steps / decode time. Since the prompt is longer than index_topk (2048)
every step's DSA selection is real. Check (untimed): one full forward (no cache) over the final sequences; the
fraction of steps whose greedy token equals the full forward's argmax, and the relative difference of the last
step's logits — the GPU backends have no decode-specific kernel, they run their training ops on one query per row.
On a CPU (``--device cpu``, fp32, ``--preset tiny``) the same code runs as a smoke test.
Prints one JSON object (figures, device, command); ``--json PATH`` also writes it.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_glm5.config import GLM5Config  # noqa: E402
from megatron_glm5.generation.decode import cached_forward  # noqa: E402
from megatron_glm5.generation.kv_cache import KVCache, cache_bytes_per_token  # noqa: E402


def proxy_config(preset: str, layers: int, dense: int) -> GLM5Config:
    cfg = GLM5Config.from_preset(preset)
    changes = dict(num_hidden_layers=layers, first_k_dense_replace=dense, num_nextn_predict_layers=0)
    if cfg.shared_layers:  # an IndexShare model: the first layer full, the others reuse its top-k
        changes["indexer_types"] = ["full"] + ["shared"] * (layers - 1)
    return cfg.replace(**changes)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_one(model, cfg, batch: int, prompt_len: int, new_tokens: int, device, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, cfg.vocab_size, (batch, prompt_len), generator=g).to(device)
    cache = KVCache.for_model(model, batch, prompt_len + new_tokens)
    positions = torch.arange(prompt_len, device=device).expand(batch, -1)
    _sync(device)
    t0 = time.perf_counter()
    logits = cached_forward(model, cache, prompt, positions, last=torch.full((batch,), prompt_len - 1))[:, -1]
    _sync(device)
    prefill_s = time.perf_counter() - t0
    tokens, step_logits = [], None
    t0 = time.perf_counter()
    for step in range(new_tokens):
        token = logits.float().argmax(-1)
        tokens.append(token)
        if step == new_tokens - 1:
            break
        pos = torch.full((batch, 1), prompt_len + step, device=device)
        step_logits = cached_forward(model, cache, token[:, None], pos)[:, -1]
        logits = step_logits
    _sync(device)
    decode_s = time.perf_counter() - t0
    generated = torch.stack(tokens, dim=1)  # [b, new_tokens]
    steps = new_tokens - 1  # forwards run after the prefill

    seq = torch.cat([prompt, generated[:, :-1]], dim=1)
    with torch.no_grad():
        full = model(seq)[:, prompt_len - 1:]  # logits that chose each generated token
    agree = (full.float().argmax(-1) == generated).float().mean().item()
    last_rel = None
    if step_logits is not None:
        ref = full[:, -1].float()
        last_rel = float((step_logits.float() - ref).abs().max() / ref.abs().max())
    return {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
            "prefill_ms": round(prefill_s * 1e3, 2), "prefill_tokens_per_s": round(batch * prompt_len / prefill_s, 1),
            "decode_ms_per_step": round(decode_s * 1e3 / max(steps, 1), 3),
            "decode_tokens_per_s": round(batch * steps / decode_s, 1) if steps else None,
            "cache_bytes_per_token": cache.bytes_per_token(),
            "check_greedy_agreement": round(agree, 4), "check_last_logits_rel_diff": last_rel}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="glm5.3")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dense", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    p.add_argument("--attn", default="torch,triton", help="comma-separated attention backends")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args(argv)

    from megatron_glm5.model.model import build_model

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = proxy_config(args.preset, args.layers, args.dense)
    results = []
    for attn in args.attn.split(","):
        torch.manual_seed(0)
        with torch.device(device):
            model = build_model(cfg, mtp=False, params_dtype=dtype, bf16=dtype == torch.bfloat16, dsa_backend=attn,
                                dsa_stage="sparse", use_cpu_initialization=device.type == "cpu").eval()
        for b in (int(x) for x in args.batch.split(",")):
            run_one(model, cfg, b, min(args.prompt_len, 64), 4, device)  # warm-up (kernel compilation)
            row = run_one(model, cfg, b, args.prompt_len, args.new_tokens, device)
            row["attn"] = attn
            results.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out = {"benchmark": "decode", "date": time.strftime("%Y-%m-%d"),
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "dtype": str(dtype).replace("torch.", ""),
           "model": {"preset": args.preset, "layers": args.layers, "dense": args.dense,
                     "indexer_types": cfg.indexer_types, "index_topk": cfg.index_topk},
           "cache_bytes_per_token_full_model_bf16": cache_bytes_per_token(GLM5Config.from_preset(args.preset)),
           "command": " ".join(["python", "benchmarks/decode.py", *(argv if argv is not None else sys.argv[1:])]),
           "results": results}
    print(json.dumps(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    from megatron_glm5.quiet import install_for_tool
    install_for_tool()
    main()
