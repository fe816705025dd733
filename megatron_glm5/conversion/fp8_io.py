"""FP8 in the GLM-5-FP8 release's layout, both directions of the converter (fp8/blocks.py holds the format).

The release (DeepSeek-V3 style) stores every large matrix as ``float8_e4m3fn`` with a float32
``<name>.weight_scale_inv`` of one scale per 128x128 block (``ceil(rows/128) x ceil(cols/128)``: the last block
of ``kv_a_proj_with_mqa`` [576, 6144] covers 64 rows), and keeps in bf16/fp32 the embeddings, the lm_head, every
norm, the router (``mlp.gate`` and its ``e_score_correction_bias``), the indexer's ``weights_proj`` and the MTP
layer's projections (``eh_proj``, ``shared_head``): the release's list (GLM5_REFERENCE.md) and transformers'
(``modules_to_not_convert``; ``GlmMoeDsaPreTrainedModel._keep_in_fp32_modules`` adds ``indexer.weights_proj``,
``_keep_in_fp32_modules_strict`` ``gate.weight`` and ``e_score_correction_bias``). :data:`QUANTIZATION_CONFIG` is
the config.json entry transformers' FineGrainedFP8 quantizer reads.

Import (``convert_hf_to_megatron(..., keep_fp8=True)``, ``--keep-fp8``): the megatron model with the frozen FP8
base (``--base-precision fp8``) holds each FP8 HF tensor and its scales as they are, byte for byte
(:func:`scale_rows` adds the scales to the name table). The indexer's ``wq_b`` / ``wk`` are FP8 in the release but
bf16 in our model (``--train-indexer`` trains them): they are dequantised, as every FP8 tensor is without
``--keep-fp8``.

Export (``convert_megatron_to_hf(..., dtype="fp8")``, ``--dtype fp8``): every FP8-eligible HF matrix
(:func:`is_fp8_weight`) is written as e4m3 + ``weight_scale_inv``: copied as stored when the checkpoint holds it in
FP8 (FP8 in -> FP8 out is bitwise: scales kept, never re-derived), quantised (fp8/blocks.py, 128-row bands) when it
is bf16/fp32; every other tensor as stored. ``--dtype auto`` on an FP8-base checkpoint writes the same layout;
``--dtype bf16/fp32`` dequantises it (weights times their scales; never the raw e4m3 values).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Dict, List, Optional, Tuple

import torch

from megatron_glm5.conversion.hf_mapping import (TensorMapping, conversion_plan, hf_placements, hf_shapes_from_mcore,
                                                 mcore_checkpoint_key)
from megatron_glm5.conversion.safetensors_stream import OutTensor
from megatron_glm5.conversion.tensor_jobs import ExportTensorJob, LayoutMismatch
from megatron_glm5.conversion.torch_dist_stream import TorchDistReader
from megatron_glm5.errors import UserError
from megatron_glm5.fp8.blocks import BLOCK, FP8_DTYPE, SCALE_SUFFIX, dequantize_blocks, quantize_blocks

HF_SCALE_SUFFIX = "weight_scale_inv"  # HF: <module>.weight -> <module>.weight_scale_inv
MCORE_SCALE_SUFFIX = SCALE_SUFFIX  # megatron: <tensor> -> <tensor>_scale_inv (fp8/blocks.py)
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [BLOCK, BLOCK]}  # + modules_to_not_convert(cfg, include_mtp)
# the HF matrices the release stores in FP8 (per decoder layer, MTP's inner layer included)
_FP8_WEIGHT = re.compile(
    r"model\.layers\.\d+\.(self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|indexer\.wq_b|indexer\.wk)"
    r"|mlp\.(gate_proj|up_proj|down_proj)|mlp\.shared_experts\.(gate_proj|up_proj|down_proj)"
    r"|mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj))\.weight")


def modules_to_not_convert(cfg, include_mtp: bool) -> List[str]:
    """The export's ``modules_to_not_convert`` in the release's form: full module names, layer by layer (the MoE
    layers' router ``mlp.gate``, every full-indexer layer's indexer projection, the MTP layer's embedding, norms,
    ``eh_proj`` and ``shared_head``), so that every loader's matching rule finds them -- exact names (vLLM's default),
    dot-boundary or prefix (sglang, transformers) and plain substrings. Short suffixes would not: ``mlp.gate`` is a
    substring of the dense layers' ``mlp.gate_proj``. The indexer's projection is named twice: by its real name
    ``self_attn.indexer.weights_proj`` and as the releases spell it, ``self_attn.indexers_proj`` (a name no module
    has, which loaders of the release translate; docs/fp8.md gives the sources)."""
    names = ["model.embed_tokens", "lm_head"]
    n = cfg.num_hidden_layers
    mtp = range(n, n + (cfg.num_nextn_predict_layers or 0)) if include_mtp else range(0)
    layers = [(i, cfg.mlp_layer_types[i] == "sparse", cfg.indexer_types[i] == "full") for i in range(n)]
    layers += [(i, True, True) for i in mtp]  # conversion_plan: the MTP layer is MoE with a full indexer
    for i, moe, full in layers:
        prefix = f"model.layers.{i}."
        if moe:
            names.append(prefix + "mlp.gate")
        if full:
            names += [prefix + "self_attn.indexer.weights_proj", prefix + "self_attn.indexers_proj"]
        if i in mtp:
            names += [prefix + m for m in ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head.norm",
                                           "shared_head.head")]
    return names


class FP8ConversionError(UserError, ValueError):
    """An FP8 conversion input or flag the user has to fix."""


def is_fp8_weight(hf_key: str) -> bool:
    """Whether the release stores this HF tensor in FP8 (with a weight_scale_inv)."""
    return bool(_FP8_WEIGHT.fullmatch(hf_key))


def hf_scale_key(hf_key: str) -> str:
    return hf_key[: -len("weight")] + HF_SCALE_SUFFIX


def check_block_size(block: Tuple[int, int], where: str) -> None:
    if tuple(block) != (BLOCK, BLOCK):
        raise FP8ConversionError(f"{where}: quantization_config weight_block_size {list(block)}; the FP8 base keeps "
                                 f"the release's [{BLOCK}, {BLOCK}] blocks only (convert without --keep-fp8 to "
                                 "dequantise)")


# ====================================================================== import: the scales' rows of the table
def scale_rows(rows: List[TensorMapping], model_tensors) -> List[TensorMapping]:
    """One table row per FP8 tensor of the model (``model_tensors``: its state-dict keys): the scales of the row's
    HF tensors, combined exactly as the weights are (gate|up halves, stacked experts)."""
    out = []
    for row in rows:
        if row.mcore is not None and row.mcore + MCORE_SCALE_SUFFIX in model_tensors:
            out.append(TensorMapping(row.mcore + MCORE_SCALE_SUFFIX, tuple(hf_scale_key(k) for k in row.hf),
                                     row.kind))
    return out


def kept_in_fp8(mcore_key: str, model_tensors) -> bool:
    """Whether the FP8-base model holds this tensor in FP8 (it has scales)."""
    return mcore_key + MCORE_SCALE_SUFFIX in model_tensors


# ====================================================================== export
@dataclass
class FP8Export:
    """What --dtype fp8 / an FP8 checkpoint changes in an export: per HF tensor name, how its bytes are made."""
    modes: Dict[str, dict] = field(default_factory=dict)  # name -> {"mode": ..., extra fields of the job}
    wrote_fp8: bool = False
    modules_to_not_convert: List[str] = field(default_factory=list)


def _scale_placement_block(row, reader, scale_key: str, j: int):
    shapes = hf_shapes_from_mcore(row, reader.shape(scale_key))
    return shapes[j], partial(hf_placements(row, shapes)[j].mcore_block, shapes[j])


def plan_fp8_export(cfg, reader: TorchDistReader, include_mtp: bool, dtype: Optional[torch.dtype], items,
                    item_type, where: str):
    """Rewrite the export plan's ``items`` (convert.plan_export's ExportItems) for FP8: returns (items, FP8Export).

    ``dtype`` FP8_DTYPE: eligible matrices in FP8 (copied or quantised) plus their scale tensors; None (auto): the
    same when the checkpoint holds an FP8 base; bf16/fp32: FP8-stored tensors dequantised."""
    plan = FP8Export(modules_to_not_convert=modules_to_not_convert(cfg, include_mtp))
    if dtype is None and any(reader.dtype(k) == FP8_DTYPE for k in reader.tensor_keys() if "optimizer." not in k):
        dtype = FP8_DTYPE  # auto on an FP8 base: the release's layout again
    by_name = {it.out.name: it for it in items}
    extra = []
    for row in conversion_plan(cfg, include_mtp=include_mtp):
        state_key = row.tied_to if row.kind == "tied" else row.mcore
        key = mcore_checkpoint_key(state_key)
        scale_key = key + MCORE_SCALE_SUFFIX
        stored_fp8 = key in reader and reader.dtype(key) == FP8_DTYPE
        if stored_fp8 and scale_key not in reader:
            raise FP8ConversionError(f"{where}: {key} is stored in FP8 but its scales {scale_key} are missing")
        shapes = hf_shapes_from_mcore(row, reader.shape(key))
        for j, (hf_key, shape) in enumerate(zip(row.hf, shapes)):
            item = by_name[hf_key]
            want_fp8 = dtype == FP8_DTYPE and is_fp8_weight(hf_key)
            if not want_fp8:
                if stored_fp8:  # --dtype bf16/fp32 (or fp8 for a tensor the release keeps): weights times scales
                    _, s_block = _scale_placement_block(row, reader, scale_key, j)
                    plan.modes[hf_key] = dict(mode="dequantize", scale_key=scale_key, scale_block=s_block)
                    if item.out.dtype == FP8_DTYPE:
                        item.out = OutTensor(hf_key, torch.bfloat16, item.out.shape)
                elif item.out.dtype == FP8_DTYPE:  # --dtype fp8: what the release keeps stays as stored
                    item.out = OutTensor(hf_key, reader.dtype(key), item.out.shape)
                continue
            if len(shape) != 2:
                raise FP8ConversionError(f"{where}: {hf_key} {list(shape)} is not a matrix; FP8 export needs "
                                         "[rows, cols] weights")
            item.out = OutTensor(hf_key, FP8_DTYPE, item.out.shape)
            s_name = hf_scale_key(hf_key)
            s_shape = (math.ceil(shape[0] / BLOCK), math.ceil(shape[1] / BLOCK))
            plan.wrote_fp8 = True
            if stored_fp8:  # as stored, both tensors: bitwise
                got_shape, s_block = _scale_placement_block(row, reader, scale_key, j)
                if tuple(got_shape) != s_shape:
                    raise FP8ConversionError(
                        f"{where}: {scale_key} gives {hf_key} scales of shape {list(got_shape)}, not the "
                        f"{list(s_shape)} of {BLOCK}x{BLOCK} blocks the release expects")
                extra.append(item_type(OutTensor(s_name, torch.float32, s_shape), scale_key, s_block))
            else:  # quantised from the stored bf16/fp32 weight, one 128-row band at a time
                plan.modes[hf_key] = dict(mode="quantize", part="q")
                plan.modes[s_name] = dict(mode="quantize", part="s", weight_shape=tuple(shape))
                extra.append(item_type(OutTensor(s_name, torch.float32, s_shape), key, item.block))
    return items + extra, plan


@dataclass
class FP8ExportJob(ExportTensorJob):
    """An export job whose bytes are computed from the stored tensor in 128-row bands: ``quantize`` (part "q": the
    e4m3 weight; part "s": its scales, ``block`` then addresses the weight's rows) or ``dequantize`` (an FP8-stored
    weight times its scales at ``scale_key``/``scale_block``)."""
    mode: str = "quantize"
    part: str = "q"
    weight_shape: Tuple[int, ...] = ()
    scale_key: str = ""
    scale_block: Optional[Callable] = None

    def _rows(self, reader, key, block, r0, r1, cols):
        offsets, sizes = block(r0, r1)
        return reader.read_region(key, offsets, sizes).view(r1 - r0, cols)

    def run(self, ctx) -> None:
        reader = ctx.resource(("torch_dist", self.checkpoint), lambda: TorchDistReader(self.checkpoint))
        t = self.out
        f = ctx.file(self.path)
        f.seek(self.offset)
        rows, cols = self.weight_shape if self.part == "s" else t.shape
        band_bytes = BLOCK * cols * 4
        step = max(1, self.max_block_bytes // band_bytes) * BLOCK  # whole 128-row bands
        for r0 in range(0, rows, step):
            ctx.check_stop()
            r1 = min(rows, r0 + step)
            w = self._rows(reader, self.key, self.block, r0, r1, cols)
            if self.mode == "quantize":
                q, s = quantize_blocks(w)
                data = q if self.part == "q" else s
            else:
                s = reader.read_region(self.scale_key, *self.scale_block(r0 // BLOCK, math.ceil(r1 / BLOCK)))
                data = dequantize_blocks(w, s.view(math.ceil((r1 - r0) / BLOCK), -1), t.dtype)
            data = data.contiguous()
            f.write(memoryview(data.view(-1).view(torch.uint8).numpy()))
            ctx.progress(data.nbytes)
            del w, data
        if f.tell() != self.offset + t.nbytes:
            raise LayoutMismatch(f"{self.path}: {t.name} took {f.tell() - self.offset} bytes, planned {t.nbytes}")


def fp8_export_jobs(jobs: list, plan: FP8Export) -> list:
    """The export layout's jobs with the FP8-computed tensors' jobs replaced (same file, offset and size)."""
    out = []
    for job in jobs:
        extra = plan.modes.get(job.out.name)
        if extra is None:
            out.append(job)
            continue
        out.append(FP8ExportJob(job.path, job.offset, job.out, job.checkpoint, job.key, job.block,
                                job.max_block_bytes, **extra))
    return out


def export_hf_config(hf_config: dict, plan: FP8Export) -> dict:
    """config.json of an FP8 export: the release's quantization_config, compute dtype bf16."""
    if plan.wrote_fp8:
        hf_config["quantization_config"] = dict(QUANTIZATION_CONFIG,
                                                modules_to_not_convert=list(plan.modules_to_not_convert))
        hf_config["dtype"] = "bfloat16"
        if "torch_dtype" in hf_config:
            hf_config["torch_dtype"] = "bfloat16"
    return hf_config
