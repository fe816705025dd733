"""Tiny random transformers GlmMoeDsaForCausalLM checkpoints for tests (the reference side of parity)."""
from __future__ import annotations

import torch

from megatron_glm5.config import GLM5Config


def make_hf_model(preset: str = "tiny", seed: int = 0, **changes):
    """A random fp32 transformers GLM-5 model (eager attention) for a preset; router biases made non-zero."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    cfg = GLM5Config.from_preset(preset)
    if changes:
        cfg = cfg.replace(**changes)
    torch.manual_seed(seed)
    hf_cfg = GlmMoeDsaConfig(**cfg.to_hf())
    hf_cfg._attn_implementation = "eager"
    model = GlmMoeDsaForCausalLM(hf_cfg).float().eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.05)
    return model, cfg


def save_hf_model(model, directory) -> str:
    model.save_pretrained(directory)
    return str(directory)
