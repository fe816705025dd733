"""User-facing entry points shared by tools, tests and notebooks.

    model = from_hf_pretrained("/path/to/GLM-5.3", dtype=torch.bfloat16)
    model = load_checkpoint("runs/sft")   # a training checkpoint (--save root or iter_XXXXXXX), any layout
    logits = model(input_ids)          # [batch, seq, vocab], same order as transformers' logits
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_glm5.config import GLM5Config
from megatron_glm5.conversion.hf_mapping import conversion_plan, hf_to_mcore_tensor, mcore_checkpoint_key
from megatron_glm5.conversion.safetensors_io import CheckpointError, HFCheckpointReader


def _single_process_model(cfg: GLM5Config, has_mtp: bool, mtp: Optional[bool], dtype: torch.dtype,
                          device: Optional[str], overrides: dict, where: str, error: type):
    """(model, mtp): the uninitialised single-process model a loader fills; ``mtp`` defaults to ``has_mtp``."""
    from megatron_glm5.model.model import build_model

    if mtp is None:
        mtp = has_mtp
    elif mtp and not has_mtp:
        raise error(f"{where}: mtp=True but the checkpoint has no MTP layer")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    overrides.setdefault("params_dtype", dtype)
    overrides.setdefault("use_cpu_initialization", device == "cpu")
    overrides.setdefault("perform_initialization", False)
    with torch.device(device):
        model = build_model(cfg, mtp=mtp, **overrides)
    model.glm5_config = cfg  # the HF-level config (eos ids, max positions) for generation (generation/cli.py)
    return model, mtp


def from_hf_pretrained(path: str, dtype: torch.dtype = torch.float32, device: Optional[str] = None,
                       mtp: Optional[bool] = None, **overrides):
    """Load an HF GlmMoeDsa directory (config.json + safetensors, sharded or not) into a single-process model.

    ``mtp``: also load the MTP layer (HF layer ``num_hidden_layers``); default: when the checkpoint has it.
    ``overrides`` go to GLM5Config.to_transformer_config (e.g. dsa_backend="torch").
    Tensors are read one group at a time; the model is returned in eval mode.
    """
    cfg = GLM5Config.from_hf(path)
    reader = HFCheckpointReader(path)
    mtp_key = f"model.layers.{cfg.num_hidden_layers}.eh_proj.weight"
    model, mtp = _single_process_model(cfg, bool(cfg.num_nextn_predict_layers) and mtp_key in reader, mtp, dtype,
                                       device, overrides, f"{path} (no {mtp_key})", CheckpointError)
    load_hf_weights(model, reader, cfg, include_mtp=mtp)
    return model.eval()


def load_hf_weights(model, reader: HFCheckpointReader, cfg: GLM5Config, include_mtp: bool) -> None:
    """Copy every tensor of the checkpoint into ``model`` (single stage) through the one conversion table."""
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    seen = set()
    for row in conversion_plan(cfg, include_mtp=include_mtp):
        if row.kind == "tied":
            continue
        if row.mcore not in params:
            raise CheckpointError(f"model has no tensor {row.mcore} (conversion table and model disagree)")
        target = params[row.mcore]
        source = hf_to_mcore_tensor(row, [reader.get(k) for k in row.hf])
        if tuple(source.shape) != tuple(target.shape):
            raise CheckpointError(f"{reader.directory}: {row.hf[0]} gives shape {tuple(source.shape)} for "
                                  f"{row.mcore}, expected {tuple(target.shape)} (config.json and weights disagree?)")
        with torch.no_grad():
            target.copy_(source.to(dtype=target.dtype))
        seen.add(row.mcore)
    missing = [n for n in params if n not in seen and n in dict(model.named_parameters())]
    if missing:
        raise CheckpointError(f"{len(missing)} model parameter(s) not covered by the checkpoint, e.g. {missing[0]}")


def load_checkpoint(path: str, dtype: torch.dtype = torch.float32, device: Optional[str] = None,
                    mtp: Optional[bool] = None, verify: bool = True, **overrides):
    """Load a megatron-glm5 torch_dist checkpoint into a single-process model, in eval mode (notebooks).

    ``path``: a --save root (its latest pointer), one ``iter_XXXXXXX`` directory, or a converted checkpoint, saved
    at any parallel layout (torch_dist stores global tensors; each is read whole from the chunks that hold it,
    optimizer state is never read). The model config is the checkpoint's own record. ``verify``: check the files
    against the checkpoint's manifest first (a damaged checkpoint is refused). ``mtp``: also build and load the MTP
    layer; default: when the checkpoint has it. ``overrides`` go to GLM5Config.to_transformer_config.
    """
    from megatron_glm5.conversion.convert import ConversionError, resolve_checkpoint_dir
    from megatron_glm5.conversion.torch_dist_stream import TorchDistReader

    directory = resolve_checkpoint_dir(path, verify=verify, flag="load_checkpoint:",
                                       skip_hint="pass verify=False to load it anyway")
    reader = TorchDistReader(directory)
    try:
        record = reader.record()
        cfg = GLM5Config.from_hf(record.model_config)
        model, mtp = _single_process_model(cfg, bool(cfg.num_nextn_predict_layers) and bool(record.mtp), mtp,
                                           dtype, device, overrides, directory, ConversionError)
        load_torch_dist_weights(model, reader)
    finally:
        reader.close()
    return model.eval()


def load_torch_dist_weights(model, reader) -> None:
    """Copy every tensor of a single-stage ``model``'s state dict from a torch_dist checkpoint (``TorchDistReader``),
    each read whole under its checkpoint key (``hf_mapping.mcore_checkpoint_key``)."""
    targets = dict(model.named_parameters())
    targets.update(dict(model.named_buffers()))
    for name in model.state_dict():
        if name.endswith("_extra_state"):
            continue
        key = mcore_checkpoint_key(name)
        target = targets[name]
        if key not in reader:
            raise CheckpointError(f"{reader.path}: the checkpoint has no tensor {key} (for {name}); a checkpoint of "
                                  "another model, or saved without that layer")
        if tuple(reader.shape(key)) != tuple(target.shape):
            raise CheckpointError(f"{reader.path}: {key} has shape {tuple(reader.shape(key))}, the model's {name} "
                                  f"{tuple(target.shape)} (the record's config and the tensors disagree)")
        with torch.no_grad():
            target.copy_(reader.read_region(key, (0,) * target.dim(), tuple(target.shape)))
