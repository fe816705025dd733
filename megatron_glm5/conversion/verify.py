"""Checks behind tools/verify_conversion.py: an HF directory against a torch_dist checkpoint.

``compare_tensors`` streams both sides block by block through the one table (bitwise comparison when the dtypes
agree, FP8 sources dequantised first); ``compare_logits`` builds our model twice — from the HF directory
(``from_hf_pretrained``) and from the torch_dist checkpoint through megatron-core's own ``dist_checkpointing.load``
(an independent reader) — and optionally transformers' model, and compares their logits on one prompt.
"""
from __future__ import annotations

import os

import torch

from megatron_glm5.config import GLM5Config
from megatron_glm5.conversion.convert import (
    FP8_DTYPES,
    _fp8_block,
    dequantize_fp8,
    read_glm5_entry,
    resolve_checkpoint_dir,
)
from megatron_glm5.conversion.hf_mapping import (
    conversion_plan,
    hf_placements,
    hf_shapes_from_mcore,
    mcore_checkpoint_key,
)
from megatron_glm5.conversion.safetensors_stream import SafetensorsSource
from megatron_glm5.conversion.torch_dist_stream import TorchDistReader


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def compare_tensors(hf_dir: str, ckpt: str, atol: float = 0.0, block_bytes: int = 256 * 2 ** 20,
                    verify: bool = False) -> dict:
    """Every tensor of both sides; ``verify``: check the checkpoint against its manifest first."""
    source = SafetensorsSource(hf_dir)
    try:
        path = resolve_checkpoint_dir(ckpt, verify=verify)
    except BaseException:
        source.close()
        raise
    reader = TorchDistReader(path)
    cfg = GLM5Config.from_hf(read_glm5_entry(path, reader).model_config)
    block = _fp8_block(GLM5Config.from_hf(os.path.join(hf_dir, "config.json")))
    n_mtp = cfg.num_nextn_predict_layers
    hf_mtp = bool(n_mtp) and f"model.layers.{cfg.num_hidden_layers}.eh_proj.weight" in source
    mc_mtp = bool(n_mtp) and mcore_checkpoint_key("mtp.layers.0.eh_proj.weight") in reader
    report = {"total": 0, "identical": 0, "close": 0, "different": []}
    if hf_mtp != mc_mtp:
        report["different"].append(f"MTP layer: HF has it {hf_mtp}, torch_dist has it {mc_mtp}")
    used = set()
    try:
        for row in conversion_plan(cfg, include_mtp=hf_mtp and mc_mtp):
            key = mcore_checkpoint_key(row.tied_to if row.kind == "tied" else row.mcore)
            if key not in reader:
                report["different"].append(f"{key}: missing from the torch_dist checkpoint")
                continue
            shapes = hf_shapes_from_mcore(row, reader.shape(key))
            for hf_key, shape, placement in zip(row.hf, shapes, hf_placements(row, shapes)):
                if hf_key not in source:
                    if row.kind != "tied":
                        report["different"].append(f"{hf_key}: missing from the HF checkpoint")
                    continue
                used.add(hf_key)
                report["total"] += 1
                info = source.info(hf_key)
                if tuple(info.shape) != tuple(shape):
                    report["different"].append(f"{hf_key}: shape {list(info.shape)} vs {list(shape)}")
                    continue
                fp8 = info.dtype in FP8_DTYPES
                scale_key = hf_key[: -len("weight")] + "weight_scale_inv"
                if fp8:
                    used.add(scale_key)
                rows = shape[0] if shape else 1
                row_bytes = max(1, info.row_bytes) * 4
                step = max(1, block_bytes // row_bytes)
                if fp8:
                    step = max(block[0], step // block[0] * block[0])
                status = "identical"
                for r0 in range(0, rows, step):
                    r1 = min(rows, r0 + step)
                    a = source.read_rows(hf_key, r0, r1)
                    if fp8:
                        a = dequantize_fp8(a, source.read_rows(scale_key, r0 // block[0], -(-r1 // block[0])), block,
                                           torch.bfloat16)
                    offsets, sizes = placement.mcore_block(shape, r0, r1)
                    b = reader.read_region(key, offsets, sizes).view(a.shape)
                    if a.dtype == b.dtype and _bitwise_equal(a, b):
                        continue
                    diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
                    if a.dtype != b.dtype and diff <= atol:
                        status = "close"
                        continue
                    status = f"{hf_key}: {a.dtype} vs {b.dtype}, max |diff| {diff:.3e} (rows {r0}..{r1})"
                    break
                if status == "identical":
                    report["identical"] += 1
                elif status == "close":
                    report["close"] += 1
                else:
                    report["different"].append(status)
        extra = sorted(set(source.keys()) - used)
        if not (hf_mtp and mc_mtp) and n_mtp:
            extra = [k for k in extra if not k.startswith(f"model.layers.{cfg.num_hidden_layers}.")]
        for k in extra:
            report["different"].append(f"{k}: in the HF checkpoint only")
    finally:
        source.close()
        reader.close()
    return report


def load_megatron_model(ckpt: str, dtype=torch.float32, mtp=None):
    """Our model (single process) with weights read by megatron-core's dist_checkpointing.load."""
    from megatron.core import dist_checkpointing

    from megatron_glm5 import platform
    from megatron_glm5.model.model import build_model

    path = resolve_checkpoint_dir(ckpt)
    reader = TorchDistReader(path)
    entry = read_glm5_entry(path, reader)
    cfg = GLM5Config.from_hf(entry.model_config)
    has_mtp = bool(cfg.num_nextn_predict_layers) and mcore_checkpoint_key("mtp.layers.0.eh_proj.weight") in reader
    reader.close()
    platform.initialize_model_parallel()
    model = build_model(cfg, mtp=has_mtp if mtp is None else mtp, params_dtype=dtype,
                        perform_initialization=False, use_cpu_initialization=True)
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, path)
    result = model.load_state_dict(loaded["model"], strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing:
        raise RuntimeError(f"{path}: model tensors not loaded: {missing[:3]}")
    return model.eval(), cfg


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def compare_logits(hf_dir: str, ckpt: str, transformers: bool = False, prompt_length: int = 32,
                   seed: int = 0) -> dict:
    import megatron_glm5

    mc_model, cfg = load_megatron_model(ckpt)
    hf_model = megatron_glm5.from_hf_pretrained(hf_dir, dtype=torch.float32, device="cpu")
    ids = torch.randint(0, cfg.vocab_size, (1, prompt_length), generator=torch.Generator().manual_seed(seed))
    out = {}
    with torch.no_grad():
        ref = hf_model(ids)
        out["ours(torch_dist) vs ours(HF)"] = _rel(mc_model(ids), ref)
        if transformers:
            from transformers import AutoModelForCausalLM
            from transformers.utils import logging as hf_logging

            hf_logging.set_verbosity_error()  # its load report lists the MTP tensors it has no module for
            theirs = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
            out["transformers vs ours(HF)"] = _rel(theirs.eval()(input_ids=ids).logits, ref)
    return out
