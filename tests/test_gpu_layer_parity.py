"""bf16 on a GPU: full-width GLM-5 layers (one dense, one MoE with 256 experts) against transformers on the same
random weights. Runs on the device machine (see docs/performance.md); skipped on CPU.

Writes the measured relative L2 errors to $GLM5_RESULTS_DIR/gpu_layer_parity.json when that is set.
"""
import json
import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SEQ = int(os.environ.get("GLM5_PARITY_SEQ", "4096"))  # > index_topk 2048: DSA selects


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_full_width_dense_and_moe_layer_bf16():
    import megatron_glm5
    from megatron_glm5 import GLM5Config, build_model
    from megatron_glm5.conversion.hf_mapping import hf_to_mcore
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    megatron_glm5.initialize_model_parallel(seed=0)
    cfg = GLM5Config.from_preset("glm5.3").replace(num_hidden_layers=2, first_k_dense_replace=1)
    hf_cfg = GlmMoeDsaConfig(**cfg.to_hf())
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = GlmMoeDsaForCausalLM(hf_cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():  # transformers keeps these fp32
            if name.endswith("mlp.gate.weight") or "weights_proj" in name:
                p.data = p.data.float()
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.data = torch.randn_like(b, dtype=torch.float32) * 0.01
    ours = build_model(cfg, mtp=False, params_dtype=torch.bfloat16, bf16=True, perform_initialization=False,
                       use_cpu_initialization=False, dsa_backend="torch").eval()
    state = hf_to_mcore(hf.state_dict(), cfg, include_mtp=False)
    missing = ours.load_state_dict({k: v for k, v in state.items()}, strict=False)
    assert not [k for k in missing.missing_keys if "_extra_state" not in k], missing.missing_keys

    ids = torch.randint(0, cfg.vocab_size, (1, SEQ), device="cuda")
    theirs, mine = [], []
    hooks = [l.register_forward_hook(lambda m, a, o: theirs.append(o[0] if isinstance(o, tuple) else o) and None)
             for l in hf.model.layers]
    hooks += [l.register_forward_hook(lambda m, a, o: mine.append(o[0].transpose(0, 1)) and None)
              for l in ours.decoder.layers]
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        out = ours(ids)
    for h in hooks:
        h.remove()
    result = {"seq": SEQ, "dense_layer_rel_l2": _rel(mine[0], theirs[0]), "moe_layer_rel_l2": _rel(mine[1], theirs[1]),
              "logits_rel_l2": _rel(out, ref), "device": torch.cuda.get_device_name()}
    print(json.dumps(result))
    if os.environ.get("GLM5_RESULTS_DIR"):
        with open(os.path.join(os.environ["GLM5_RESULTS_DIR"], "gpu_layer_parity.json"), "w") as f:
            json.dump(result, f, indent=1)
    assert result["dense_layer_rel_l2"] < 1e-2 and result["moe_layer_rel_l2"] < 1e-2
