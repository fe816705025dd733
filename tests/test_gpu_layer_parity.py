"""Full-width GLM-5 layers on a GPU against transformers on the same random weights (a GPU machine only).

fp32: our model equals transformers' (64 experts so that two fp32 copies fit one GPU).
bf16: bf16 rounding makes both implementations drift from the exact (fp32) result, and with DSA a tiny score
change flips top-k choices among near-equal random-weight index scores, so the honest yardstick is the fp32
model: our bf16 output must be at least as close to it as transformers' bf16 output is. The figures are
written to $GLM5_RESULTS_DIR (docs/performance.md quotes them).
"""
import json
import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _setup(n_experts=None):
    import megatron_glm5
    from megatron_glm5 import GLM5Config
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    megatron_glm5.initialize_model_parallel(seed=0)
    cfg = GLM5Config.from_preset("glm5.3").replace(num_hidden_layers=2, first_k_dense_replace=1)
    if n_experts:
        cfg = cfg.replace(n_routed_experts=n_experts)
    hf_cfg = GlmMoeDsaConfig(**cfg.to_hf())
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = GlmMoeDsaForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.01)
    return cfg, hf


def _to_bf16_like_transformers(hf):
    hf.to(torch.bfloat16)
    for name, p in hf.named_parameters():  # transformers keeps these in fp32
        if name.endswith("mlp.gate.weight") or "weights_proj" in name:
            p.data = p.data.float()
    for name, b in hf.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.data = b.data.float()


def _ours_from(hf, cfg, dtype):
    from megatron_glm5 import build_model
    from megatron_glm5.conversion.hf_mapping import hf_to_mcore

    ours = build_model(cfg, mtp=False, params_dtype=dtype, bf16=dtype == torch.bfloat16, perform_initialization=False,
                       use_cpu_initialization=False, dsa_backend="torch").eval()
    state = hf_to_mcore(hf.state_dict(), cfg, include_mtp=False)
    result = ours.load_state_dict(state, strict=False)
    del state
    assert not [k for k in result.missing_keys if "_extra_state" not in k], result.missing_keys
    return ours


def _run(model, ids, ours: bool):
    layers = model.decoder.layers if ours else model.model.layers
    outs, topk = [], {}
    hooks = [l.register_forward_hook(
        lambda m, a, o: outs.append((o[0].transpose(0, 1) if ours else (o[0] if isinstance(o, tuple) else o)).float()) and None)
        for l in layers]
    if ours:
        hooks.append(layers[0].self_attention.register_forward_pre_hook(
            lambda m, a, kw: topk.__setitem__("inputs", kw["rotary_pos_emb"]), with_kwargs=True))
    else:
        hooks.append(layers[0].self_attn.indexer.register_forward_hook(lambda m, a, o: topk.__setitem__("idx", o) and None))
    with torch.no_grad():
        logits = model(ids) if ours else model(input_ids=ids).logits
    for h in hooks:
        h.remove()
    idx = topk["inputs"].topk_store[1].view(ids.shape[0], ids.shape[1], -1) if ours else topk["idx"]
    return outs, logits.float(), idx.long()


def _overlap(a, b, start, k):
    rows = range(start, a.shape[1], max(1, (a.shape[1] - start) // 64))
    same = sum(len(set(a[0, t].tolist()) & set(b[0, t].tolist())) for t in rows)
    return same / (k * len(rows))


def _write(name, result):
    print(json.dumps(result))
    if os.environ.get("GLM5_RESULTS_DIR"):
        with open(os.path.join(os.environ["GLM5_RESULTS_DIR"], name), "w") as f:
            json.dump(result, f, indent=1)


def test_full_width_fp32_equals_transformers():
    cfg, hf = _setup(n_experts=64)
    ours = _ours_from(hf, cfg, torch.float32)
    ids = torch.randint(0, cfg.vocab_size, (1, 4096), device="cuda")
    theirs, ref, _ = _run(hf, ids, ours=False)
    mine, out, _ = _run(ours, ids, ours=True)
    result = {"dtype": "float32", "seq": 4096, "experts": 64, "dense_layer": _rel(mine[0], theirs[0]),
              "moe_layer": _rel(mine[1], theirs[1]), "logits": _rel(out, ref)}
    _write("gpu_parity_fp32.json", result)
    assert max(result["dense_layer"], result["moe_layer"], result["logits"]) < 1e-4


def test_full_width_bf16_as_accurate_as_transformers():
    cfg, hf = _setup()
    results = {}
    seqs = (1024, 4096)  # <= and > index_topk 2048
    ids = {s: torch.randint(0, cfg.vocab_size, (1, s), device="cuda") for s in seqs}
    exact = {s: _run(hf, ids[s], ours=False) for s in seqs}  # fp32 transformers = the yardstick
    _to_bf16_like_transformers(hf)
    theirs = {s: _run(hf, ids[s], ours=False) for s in seqs}
    ours = _ours_from(hf, cfg, torch.bfloat16)
    del hf
    torch.cuda.empty_cache()
    mine = {s: _run(ours, ids[s], ours=True) for s in seqs}
    for s in seqs:
        (e_layers, e_logits, e_idx), (t_layers, t_logits, t_idx), (m_layers, m_logits, m_idx) = exact[s], theirs[s], mine[s]
        r = {}
        for i, name in enumerate(("dense_layer", "moe_layer")):
            r[f"{name}_ours_vs_fp32"] = _rel(m_layers[i], e_layers[i])
            r[f"{name}_transformers_vs_fp32"] = _rel(t_layers[i], e_layers[i])
            r[f"{name}_ours_vs_transformers"] = _rel(m_layers[i], t_layers[i])
        r["logits_ours_vs_fp32"] = _rel(m_logits, e_logits)
        r["logits_transformers_vs_fp32"] = _rel(t_logits, e_logits)
        if s > cfg.index_topk:
            k = cfg.index_topk
            r["topk_overlap_ours_vs_fp32"] = _overlap(m_idx, e_idx, k, k)
            r["topk_overlap_transformers_vs_fp32"] = _overlap(t_idx, e_idx, k, k)
            r["topk_overlap_ours_vs_transformers"] = _overlap(m_idx, t_idx, k, k)
        results[str(s)] = r
    _write("gpu_parity_bf16.json", results)
    for s, r in results.items():
        for name in ("dense_layer", "moe_layer", "logits"):
            ours_err = r[f"{name}_ours_vs_fp32"]
            theirs_err = r[f"{name}_transformers_vs_fp32"]
            assert ours_err <= 1.25 * theirs_err + 1e-3, f"seq {s} {name}: ours {ours_err:.4f} vs transformers {theirs_err:.4f}"
