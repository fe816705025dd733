"""megatron-glm5: pretrain and fine-tune the GLM-5 family on megatron-core.

Public API::

    from megatron_glm5 import GLM5Config, build_model, from_hf_pretrained
    cfg = GLM5Config.from_preset("tiny")          # or GLM5Config.from_hf("path/to/hf_dir")
    model = build_model(cfg)                      # single process: initialises parallel state itself
    model = from_hf_pretrained("path/to/hf_dir")  # HF weights -> megatron model, eval mode
    model = load_checkpoint("runs/sft")           # a training checkpoint (any layout) -> model, eval mode
    logits = model(input_ids)                     # [batch, seq, vocab], HF order (see api.py)
"""
from megatron_glm5 import platform as _platform

_platform.apply_pre_import_shims()

__version__ = "0.1.0"

_LAZY = {
    "GLM5Config": ("megatron_glm5.config", "GLM5Config"),
    "ConfigError": ("megatron_glm5.config", "ConfigError"),
    "build_model": ("megatron_glm5.model.model", "build_model"),
    "from_hf_pretrained": ("megatron_glm5.api", "from_hf_pretrained"),
    "load_checkpoint": ("megatron_glm5.api", "load_checkpoint"),
    "initialize_model_parallel": ("megatron_glm5.platform", "initialize_model_parallel"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'megatron_glm5' has no attribute {name!r}")


__all__ = list(_LAZY)
