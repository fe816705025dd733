"""Streaming checkpoint conversion HF safetensors <-> megatron-core torch_dist, through the one name table.

The unit of work is one HF tensor, or a block of its rows: by the table (``hf_mapping``), every HF tensor is a
contiguous block of one megatron tensor (``Placement``), so both directions move data block by block and never
hold more than one block (plus fixed overhead) in memory, whatever the checkpoint size.

HF -> torch_dist (:func:`convert_hf_to_megatron`):
  1. preflight, before anything is written: config.json (architecture), the layout flags
     (``GLM5Config.validate_layout``), every safetensors header (missing or truncated shards), every tensor's
     name, dtype and shape against the table and against the megatron model built on the meta device (exact
     checkpoint keys, global shapes, the ``_extra_state`` objects megatron-core expects);
  2. one stored DCP chunk per HF tensor (row-split when larger than ``max_chunk_bytes``), each produced lazily by
     reading its bytes from the shard (FP8 e4m3 weights are dequantised with their 128x128 ``weight_scale_inv``
     blocks) and written immediately (``torch_dist_stream.save_lazy``);
  3. the common state (the ``"glm5"`` record of checkpoint/format.py: model config, layout, mode "converted")
     and megatron's ``metadata.json``, ``config.json``;
     written to ``<save>.partial`` and renamed to ``<save>`` at the end.
  torch_dist stores global tensors with offsets, so the one checkpoint loads into every parallel layout;
  ``--tp/--pp/--ep/--etp`` are validated against the model and recorded.

torch_dist -> HF (:func:`convert_megatron_to_hf`): reads the ``"glm5"`` record for the config, then each
HF tensor block straight from the stored chunks (``TorchDistReader.read_region``; only ``model`` tensors, never the
optimizer state) into sharded safetensors whose headers are computed up front.
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Optional

import torch

from megatron_glm5.checkpoint import manifest as checkpoint_manifest
from megatron_glm5.checkpoint.format import (
    COMMON_KEY,
    DCP_METADATA,
    LATEST,
    RECORD_KEY,
    ModelRecord,
    layout_record,
    pointed_dir,
    read_latest,
)
from megatron_glm5.config import ConfigError, GLM5Config
from megatron_glm5.conversion import fp8_io
from megatron_glm5.conversion.hf_mapping import (
    conversion_plan,
    hf_placements,
    hf_shapes_from_mcore,
    mcore_checkpoint_key,
)
from megatron_glm5.conversion.parallel import Runner
from megatron_glm5.conversion.progress import byte_bar, peak_rss_bytes
from megatron_glm5.conversion.safetensors_stream import (
    OutTensor,
    SafetensorsSource,
    element_size,
    parse_size,
    plan_shards,
)
from megatron_glm5.conversion.tensor_jobs import ParallelDcpWriter, create_shard_files, export_layout
from megatron_glm5.conversion.torch_dist_stream import (
    LazyChunk,
    TorchDistReader,
    save_lazy,
    serialize_object,
)
from megatron_glm5.errors import UserError

log = logging.getLogger("megatron_glm5.conversion")

DTYPE_FLAGS = {"auto": None, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
               "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32,
               "fp8": torch.float8_e4m3fn}  # export only: the release's FP8 layout (fp8_io.py)
_HF_DTYPE_STR = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
FP8_DTYPES = (torch.float8_e4m3fn,)
DEFAULT_CHUNK_BYTES = 64 * 2 ** 20
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "vocab.txt")


class ConversionError(UserError, ValueError):
    """A conversion input or flag the user has to fix (message names the file or flag)."""


def dtype_from_flag(name: str) -> Optional[torch.dtype]:
    try:
        return DTYPE_FLAGS[str(name).lower()]
    except KeyError:
        raise ConversionError(f"--dtype {name}: choose one of auto, bf16, fp16, fp32, fp8") from None


def _is_router_fp32(mcore_key: str) -> bool:
    """Router weight and expert bias: megatron keeps them in fp32; --dtype never narrows them on import."""
    return mcore_key.endswith("mlp.router.expert_bias") or mcore_key.endswith("mlp.router.weight")


def _progress(total: int, desc: str, enabled: bool):
    return byte_bar(total, desc, enabled)


# ====================================================================== megatron side of the table
@dataclass
class McoreTensorSpec:
    state_key: str
    key: str  # checkpoint (ShardedTensor) key
    global_shape: tuple[int, ...]


@dataclass
class McoreSpec:
    tensors: dict[str, McoreTensorSpec]  # by state-dict key
    objects: dict[str, object]  # ShardedObject unique key -> data (the _extra_state entries)


def megatron_checkpoint_spec(cfg: GLM5Config, mtp: bool, base_precision: str = "bf16") -> McoreSpec:
    """Exact checkpoint keys, global shapes and objects of our model, from a model built on the meta device."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories

    from megatron_glm5 import platform
    from megatron_glm5.model.model import build_model

    platform.initialize_model_parallel()  # single process, TP1/PP1/EP1 (global shapes do not depend on it)
    with torch.device("meta"):
        model = build_model(cfg, mtp=mtp, perform_initialization=False, base_precision=base_precision)
    sd = model.sharded_state_dict()
    apply_factories(sd)
    tensors, objects = {}, {}
    for state_key, value in sd.items():
        items = value if isinstance(value, list) else [value]
        if all(isinstance(x, ShardedObject) for x in items):
            for obj in items:
                if obj.data is not None and not isinstance(obj.data, (int, float, str, bool, dict, list)):
                    raise ConversionError(f"model object {obj.key} holds {type(obj.data).__name__}; cannot be "
                                          "written by the converter (megatron-core changed?)")
                objects[obj.unique_key] = obj.data
            continue
        if not all(isinstance(x, ShardedTensor) for x in items):
            raise ConversionError(f"unexpected sharded entry {state_key}: {type(items[0]).__name__}")
        keys = {x.key for x in items}
        shapes = {tuple(x.global_shape) for x in items}
        if len(keys) != 1 or len(shapes) != 1 or any(x.prepend_axis_num or x.flattened_range is not None
                                                    for x in items):
            raise ConversionError(f"{state_key}: unsupported sharded-tensor layout (megatron-core changed?)")
        key = keys.pop()
        if key != mcore_checkpoint_key(state_key):
            raise ConversionError(f"{state_key} is checkpointed as {key}, not {mcore_checkpoint_key(state_key)}: "
                                  "update hf_mapping.mcore_checkpoint_key")
        tensors[state_key] = McoreTensorSpec(state_key, key, shapes.pop())
    return McoreSpec(tensors, objects)


# ====================================================================== HF -> torch_dist
def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                   out_dtype: torch.dtype) -> torch.Tensor:
    """Block-wise FP8 dequantisation (DeepSeek/GLM format): ``w[i, j] * scale_inv[i // b0, j // b1]``, computed in
    fp32 and cast to ``out_dtype``, one band of ``b0`` rows at a time. ``weight`` rows start at a block boundary."""
    b0, b1 = block
    rows, cols = weight.shape
    out = torch.empty((rows, cols), dtype=out_dtype)
    for i in range(0, rows, b0):
        s = scale_inv[i // b0].to(torch.float32).repeat_interleave(b1)[:cols]
        out[i:i + b0] = (weight[i:i + b0].to(torch.float32) * s).to(out_dtype)
    return out


class NonFiniteGuard:
    """Import-time check of every block for NaN/Inf: refused naming the tensor and its file, or (``allow``) warned
    about once per tensor."""

    def __init__(self, allow: bool, where: str):
        self.allow, self.where, self.warned = allow, where, set()

    def check(self, source, hf_key: str, r0: int, t: torch.Tensor) -> None:
        t = t.float() if t.dtype in FP8_DTYPES else t  # FP8 kept as it is (--keep-fp8): e4m3 has NaN, no isfinite
        if not t.is_floating_point() or bool(torch.isfinite(t).all()):
            return
        n_nan, n_inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
        rows = t.reshape(max(1, t.shape[0] if t.dim() else 1), -1)
        first = r0 + int((~torch.isfinite(rows)).any(1).nonzero()[0, 0])
        file = os.path.join(self.where, source.info(hf_key).file)
        last = r0 + rows.shape[0] - 1
        what = (f"{file}: {hf_key} has non-finite values ({n_nan} NaN, {n_inf} Inf in rows {r0}..{last}, the first "
                f"in row {first})")
        if not self.allow:
            raise ConversionError(f"{what}; training from it would skip steps or diverge: fix the source, or pass "
                                  "--allow-nonfinite to convert it anyway")
        if hf_key not in self.warned:
            self.warned.add(hf_key)
            log.warning("%s; converted anyway (--allow-nonfinite)", what)


def _produce_block(source, hf_key: str, r0: int, r1: int, out_dtype: torch.dtype, sizes: tuple[int, ...],
                   scale_key: Optional[str], block: tuple[int, int],
                   guard: Optional[NonFiniteGuard] = None) -> torch.Tensor:
    t = source.read_rows(hf_key, r0, r1)
    if scale_key is not None:
        b0 = block[0]
        scale = source.read_rows(scale_key, r0 // b0, -(-r1 // b0))
        t = dequantize_fp8(t, scale, block, out_dtype)
    elif t.dtype != out_dtype:
        t = t.to(out_dtype)
    if guard is not None:
        guard.check(source, hf_key, r0, t)
    return t.view(sizes)


@dataclass
class ImportPlan:
    cfg: GLM5Config
    include_mtp: bool
    chunks: list[LazyChunk]
    objects: dict[str, object]
    tied: list[tuple[str, str]]  # (MTP copy HF key, main HF key) to compare
    hf_config: dict
    fp8: bool
    total_bytes: int = 0
    used: set = field(default_factory=set)


def _fp8_block(cfg: GLM5Config) -> tuple[int, int]:
    qc = (cfg.raw or {}).get("quantization_config") or {}
    b = qc.get("weight_block_size") or [128, 128]
    return int(b[0]), int(b[1])


def plan_import(cfg: GLM5Config, source, spec: McoreSpec, include_mtp: bool, dtype: Optional[torch.dtype],
                max_chunk_bytes: int = DEFAULT_CHUNK_BYTES, where: str = "", allow_nonfinite: bool = False,
                keep_fp8: bool = False) -> ImportPlan:
    """Check every HF tensor against the table and the model, and list the chunks to write (no data read; each
    chunk checks its values for NaN/Inf when it is produced, see NonFiniteGuard).

    ``source`` needs ``keys()``, ``info(name)`` (``.dtype``, ``.shape``, ``.file``) and ``read_rows``."""
    where = where or getattr(source, "directory", "HF checkpoint")
    guard = NonFiniteGuard(allow_nonfinite, where)
    block = _fp8_block(cfg)
    rows = conversion_plan(cfg, include_mtp=include_mtp)
    if keep_fp8:  # the FP8 base: the release's e4m3 tensors and their scales as they are (fp8_io.py)
        rows += fp8_io.scale_rows(rows, spec.tensors)
    chunks, tied, used, fp8_used = [], [], set(), False
    covered = {}

    def file_of(name):
        return os.path.join(where, source.info(name).file)

    for row in rows:
        missing = [k for k in row.hf if k not in source]
        if row.kind == "tied":
            if not missing:
                main = "model.embed_tokens.weight" if row.tied_to.startswith("embedding") else "lm_head.weight"
                tied.append((row.hf[0], main))
                used.add(row.hf[0])
            continue
        if missing:
            raise ConversionError(f"{where}: tensor {missing[0]} is missing (needed for {row.mcore}; is this a "
                                  f"complete GLM-5 checkpoint for this config.json?)")
        if row.mcore not in spec.tensors:
            raise ConversionError(f"the model has no tensor {row.mcore} (table and model disagree)")
        ms = spec.tensors[row.mcore]
        expected = hf_shapes_from_mcore(row, ms.global_shape)
        eff = []
        for k, shape in zip(row.hf, expected):
            info = source.info(k)
            src_dtype = info.dtype
            if tuple(info.shape) != tuple(shape):
                raise ConversionError(f"{file_of(k)}: {k} has shape {list(info.shape)} but config.json implies "
                                      f"{list(shape)} (weights and config.json disagree)")
            scale_key = k[: -len("weight")] + "weight_scale_inv" if k.endswith("weight") else None
            if src_dtype in FP8_DTYPES:
                if scale_key is None or scale_key not in source:
                    raise ConversionError(f"{file_of(k)}: {k} is stored as FP8 (e4m3) but its block scale "
                                          f"{scale_key} is missing (FP8 weights need their weight_scale_inv)")
                if len(shape) != 2:
                    raise ConversionError(f"{file_of(k)}: {k} is FP8 but not a matrix {list(shape)}")
                s_info = source.info(scale_key)
                s_shape = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
                if s_info.dtype not in FLOAT_DTYPES or tuple(s_info.shape) != s_shape:
                    raise ConversionError(f"{file_of(scale_key)}: {scale_key} is {s_info.dtype_name} "
                                          f"{list(s_info.shape)}; expected a float tensor of shape {list(s_shape)} "
                                          f"({block[0]}x{block[1]} blocks of {k})")
                used.add(scale_key)
                eff.append(src_dtype if keep_fp8 and fp8_io.kept_in_fp8(row.mcore, spec.tensors) else torch.bfloat16)
                fp8_used = True
            elif src_dtype in FLOAT_DTYPES:
                if keep_fp8 and fp8_io.kept_in_fp8(row.mcore, spec.tensors):
                    raise ConversionError(f"--keep-fp8: {file_of(k)}: {k} is stored as {info.dtype_name}, not FP8 "
                                          "(--keep-fp8 reads the FP8 release; convert a bf16 model without it)")
                if scale_key is not None and scale_key in source:
                    raise ConversionError(f"{file_of(scale_key)}: {scale_key} scales {k}, but {k} is stored as "
                                          f"{info.dtype_name}, not FP8")
                eff.append(src_dtype)
            else:
                raise ConversionError(f"{file_of(k)}: {k} is stored as {info.dtype_name}; expected a floating "
                                      f"point tensor (BF16, F16, F32) or F8_E4M3 with {scale_key or 'a scale'}")
            used.add(k)
        if eff and eff[0] in FP8_DTYPES:
            out_dtype = eff[0]  # --keep-fp8: bytes as stored, whatever --dtype says of the other tensors
        elif dtype is not None:
            out_dtype = torch.float32 if _is_router_fp32(row.mcore) else dtype
        else:
            if len(set(eff)) != 1:
                raise ConversionError(f"{file_of(row.hf[0])}: the tensors that form {row.mcore} have mixed dtypes "
                                      f"{sorted({str(d) for d in eff})}; pass --dtype")
            out_dtype = eff[0]
        esize = element_size(out_dtype)
        for k, shape, placement in zip(row.hf, expected, hf_placements(row, expected)):
            is_fp8 = source.info(k).dtype in FP8_DTYPES
            scale_key = k[: -len("weight")] + "weight_scale_inv" if is_fp8 and out_dtype not in FP8_DTYPES else None
            n_rows = shape[0] if shape else 1
            row_bytes = max(1, math.prod(shape[1:])) * max(esize, 4 if is_fp8 else 0, source.info(k).dtype.itemsize)
            step = max(1, max_chunk_bytes // row_bytes)
            if is_fp8:
                step = max(block[0], step // block[0] * block[0])
            for r0 in range(0, n_rows, step):
                r1 = min(n_rows, r0 + step)
                offsets, sizes = placement.mcore_block(shape, r0, r1)
                chunks.append(LazyChunk(ms.key, ms.global_shape, offsets, sizes, out_dtype,
                                        partial(_produce_block, source, k, r0, r1, out_dtype, sizes, scale_key,
                                                block, guard), source=k))
                covered[ms.key] = covered.get(ms.key, 0) + math.prod(sizes)
    for state_key, ms in spec.tensors.items():
        if covered.get(ms.key, 0) != math.prod(ms.global_shape):
            raise ConversionError(f"the conversion table does not fill {state_key} ({covered.get(ms.key, 0)} of "
                                  f"{math.prod(ms.global_shape)} elements): table and model disagree")
    unknown = sorted(set(source.keys()) - used)
    if not include_mtp and cfg.num_nextn_predict_layers:
        prefixes = tuple(f"model.layers.{cfg.num_hidden_layers + k}." for k in range(cfg.num_nextn_predict_layers))
        unknown = [k for k in unknown if not k.startswith(prefixes)]  # MTP left out on purpose (--no-mtp)
    if unknown:
        raise ConversionError(f"{file_of(unknown[0])}: {len(unknown)} tensor(s) the GLM-5 table does not know, e.g. "
                              f"{unknown[0]} (a different model, or config.json does not match the weights?)")
    hf_config = cfg.to_hf()
    if fp8_used or hf_config.get("quantization_config"):
        hf_config.pop("quantization_config", None)
    out_name = _HF_DTYPE_STR.get(dtype) if dtype is not None else ("bfloat16" if fp8_used else None)
    if out_name:
        hf_config["dtype"] = out_name
        if "torch_dtype" in hf_config:
            hf_config["torch_dtype"] = out_name
    plan = ImportPlan(cfg, include_mtp, chunks, dict(spec.objects), tied, hf_config, fp8_used, used=used)
    plan.total_bytes = sum(c.nbytes for c in chunks)
    return plan


def precheck_dtypes(source, where: str) -> None:
    """Header-only dtype check of every tensor (before anything heavy): floats, or FP8 e4m3 with its scale."""
    for name in source.keys():
        info = source.info(name)
        if name.endswith("weight_scale_inv"):
            continue
        if info.dtype in FP8_DTYPES:
            scale = name[: -len("weight")] + "weight_scale_inv" if name.endswith("weight") else None
            if scale is None or scale not in source:
                raise ConversionError(f"{os.path.join(where, info.file)}: {name} is stored as FP8 (e4m3) but its "
                                      f"block scale {scale or name + '_scale_inv'} is missing (FP8 weights need "
                                      "their weight_scale_inv)")
        elif info.dtype not in FLOAT_DTYPES:
            raise ConversionError(f"{os.path.join(where, info.file)}: {name} is stored as {info.dtype_name}; "
                                  "expected a floating point tensor (BF16, F16, F32) or F8_E4M3 with a "
                                  "weight_scale_inv")


def _check_tied(source, tied, max_block_bytes: int) -> list[str]:
    """MTP embed_tokens / shared_head.head must equal the main ones (megatron-core shares them)."""
    problems = []
    for copy, main in tied:
        a, b = source.info(copy), source.info(main)
        if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
            problems.append(f"{copy} {a.dtype_name}{list(a.shape)} differs from {main} {b.dtype_name}{list(b.shape)}")
            continue
        step = max(1, max_block_bytes // max(1, a.row_bytes))
        for r0 in range(0, a.shape[0], step):
            r1 = min(a.shape[0], r0 + step)
            if not torch.equal(source.read_rows(copy, r0, r1), source.read_rows(main, r0, r1)):
                problems.append(f"{copy} differs from {main} (rows from {r0})")
                break
    return problems


def _check_target(save: str, overwrite: bool, flag: str = "--save") -> str:
    final = os.path.abspath(save)
    if os.path.exists(final) and not overwrite:
        raise ConversionError(f"{flag} {save}: already exists (choose a new directory, or pass --overwrite)")
    parent = os.path.dirname(final)
    if not os.path.isdir(parent):
        raise ConversionError(f"{flag} {save}: parent directory {parent} does not exist")
    return final


def _replace_dir(partial_dir: str, final: str) -> None:
    old = None
    if os.path.exists(final):
        old = final + ".old"
        if os.path.exists(old):
            shutil.rmtree(old)
        os.rename(final, old)
    os.rename(partial_dir, final)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def _fresh_dir(path: str) -> None:
    """An empty temporary output directory (a killed run's leftover removed)."""
    if os.path.exists(path):
        shutil.rmtree(path)
    os.makedirs(path)


def _write_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def convert_hf_to_megatron(hf_dir: str, save: str, tp: int = 1, pp: int = 1, ep: int = 1, etp: Optional[int] = None,
                           dtype: str = "auto", mtp: Optional[bool] = None, overwrite: bool = False,
                           progress: bool = True, max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                           allow_nonfinite: bool = False, workers: int = 1, keep_fp8: bool = False) -> dict:
    """HF GlmMoeDsa directory -> torch_dist checkpoint directory ``save``. Returns a summary dict.
    ``keep_fp8``: an FP8 release -> a checkpoint of the frozen FP8 base, e4m3 tensors and scales as they are.

    NaN/Inf in a weight stops the conversion naming the tensor and its file (``allow_nonfinite``: a warning).
    ``workers``: processes writing disjoint shares of the chunks (parallel.py; same output for every value)."""
    t0 = time.time()
    final = _check_target(save, overwrite)
    runner = Runner(workers)
    out_dtype = dtype_from_flag(dtype)
    if out_dtype in FP8_DTYPES:
        raise ConversionError("--dtype fp8 is for the export; to keep an FP8 release's tensors as they are, pass "
                              "--keep-fp8")
    if not os.path.isdir(hf_dir):
        raise ConversionError(f"--hf-dir {hf_dir}: no such directory")
    cfg_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise ConversionError(f"--hf-dir {hf_dir}: no config.json")
    try:
        cfg = GLM5Config.from_hf(cfg_path)
        cfg.validate_layout(tp=tp, pp=pp, ep=ep, etp=etp)
    except ConfigError as e:
        raise ConversionError(str(e)) from None
    source = SafetensorsSource(hf_dir)
    precheck_dtypes(source, hf_dir)
    has_mtp = bool(cfg.num_nextn_predict_layers) and f"model.layers.{cfg.num_hidden_layers}.eh_proj.weight" in source
    if mtp is None:
        include_mtp = has_mtp
    elif mtp and not has_mtp:
        raise ConversionError(f"--mtp: {hf_dir} has no MTP layer (model.layers.{cfg.num_hidden_layers}.eh_proj.weight)")
    else:
        include_mtp = bool(mtp)
    if keep_fp8:
        if not any(source.info(k).dtype in FP8_DTYPES for k in source.keys()):
            raise ConversionError(f"--keep-fp8: {hf_dir} holds no FP8 weights (a bf16 model); convert it without "
                                  "--keep-fp8")
        fp8_io.check_block_size(_fp8_block(cfg), cfg_path)
    spec = megatron_checkpoint_spec(cfg, include_mtp, base_precision="fp8" if keep_fp8 else "bf16")
    if has_mtp and not include_mtp:
        log.info("%s: leaving the MTP layer out (--no-mtp)", hf_dir)
    elif cfg.num_nextn_predict_layers and not has_mtp:
        log.warning("%s: config.json has num_nextn_predict_layers %d but the weights have no MTP layer (a model "
                    "saved by transformers): converted without MTP, recorded in the checkpoint; fine-tuning from "
                    "it trains without MTP", hf_dir, cfg.num_nextn_predict_layers)
    plan = plan_import(cfg, source, spec, include_mtp, out_dtype, max_chunk_bytes, allow_nonfinite=allow_nonfinite,
                       keep_fp8=keep_fp8)
    for problem in _check_tied(source, plan.tied, max_chunk_bytes):
        log.warning("%s: %s; megatron-core ties the MTP layer's embedding and head to the main ones, so the main "
                    "tensors are used", hf_dir, problem)
    # "iteration"/"data_state" as a training checkpoint has them: --finetune ignores them, and a run with
    # --no-load-optim --no-load-rng (no --finetune) starts at iteration 0 from the first sample
    record = ModelRecord(model_config=plan.hf_config, mode="converted", mtp=include_mtp,
                         layout=layout_record(tp, pp, ep, tp if etp is None else etp, cp=1, dp=None),
                         source={"hf_dir": os.path.abspath(hf_dir), "dtype": dtype,
                                 "fp8_dequantized": plan.fp8 and not keep_fp8, "fp8_kept": keep_fp8,
                                 "mtp": has_mtp})
    common = {"iteration": 0, "data_state": {}, RECORD_KEY: record.to_common()}
    objects = {COMMON_KEY: serialize_object(common)}
    objects.update({k: serialize_object(v) for k, v in plan.objects.items()})
    partial_dir = final + ".partial"
    runner.prepare(partial(_fresh_dir, partial_dir))
    bar = _progress(plan.total_bytes, "HF -> torch_dist", progress and runner.is_coordinator)
    t_write = time.time()
    try:
        writer = ParallelDcpWriter(partial_dir, runner, final_path=final, on_item=bar.update)
        save_lazy(partial_dir, plan.chunks, objects, final_path=final, storage_writer=writer)
        plan.chunks.clear()

        def small_files():  # rank 0: config.json, generation_config.json; then the rename
            _write_json(os.path.join(partial_dir, "config.json"), plan.hf_config)
            gen = os.path.join(hf_dir, "generation_config.json")
            if os.path.isfile(gen):
                shutil.copyfile(gen, os.path.join(partial_dir, "generation_config.json"))
            _replace_dir(partial_dir, final)

        runner.prepare(small_files)
    except BaseException:
        if runner.is_coordinator:
            shutil.rmtree(partial_dir, ignore_errors=True)
        raise
    finally:
        bar.close()
        source.close()
    seconds = time.time() - t0
    return {"direction": "hf_to_megatron", "output": final, "bytes": plan.total_bytes, "seconds": seconds,
            "write_seconds": time.time() - t_write,
            "mb_per_s": plan.total_bytes / 2 ** 20 / max(seconds, 1e-9), "peak_rss_bytes": peak_rss_bytes(),
            "tensors": len(plan.used), "mtp": include_mtp, "workers": runner.used_workers,
            "worker_peak_rss_bytes": runner.worker_peak_rss}


# ====================================================================== torch_dist -> HF
NO_VERIFY_HINT = "pass --no-verify to read it anyway"


def resolve_checkpoint_dir(load: str, verify: bool = False, flag: str = "--load",
                           skip_hint: str = NO_VERIFY_HINT) -> str:
    """--load: a --save root (latest pointer), an iteration directory, or a converted checkpoint directory.

    ``verify``: check the directory against its manifest (checkpoint/manifest.py: every file's size and checksum,
    as the trainer does) before anything is read from it; a damaged checkpoint is refused naming the file and what
    is wrong. A directory without a manifest (a converted checkpoint, or one saved before manifests existed) is
    read unverified, with a warning; ``verify=False`` skips the check with a warning."""
    if not os.path.isdir(load):
        raise ConversionError(f"{flag} {load}: no such directory")
    pointer = read_latest(load)
    if pointer is not None:
        path = pointed_dir(load, pointer)
    elif os.path.isfile(os.path.join(load, DCP_METADATA)):
        path = load
    else:
        raise ConversionError(f"{flag} {load}: neither a torch_dist checkpoint (no {DCP_METADATA}) nor a --save root "
                              f"(no {LATEST})")
    if verify:
        verify_checkpoint_dir(path, flag, load, skip_hint)
    return path


def verify_checkpoint_dir(path: str, flag: str, load: str, skip_hint: str = NO_VERIFY_HINT) -> None:
    """Refuse a checkpoint directory whose files do not match its manifest (warn when it has none)."""
    if not os.path.exists(os.path.join(path, checkpoint_manifest.MANIFEST)):
        log.warning("%s: no %s (a converted checkpoint, or one saved before checkpoints had manifests): its files "
                    "are read unverified", path, checkpoint_manifest.MANIFEST)
        return
    problems = checkpoint_manifest.verify(path)
    if problems:
        older = "" if path == load else f" (e.g. an older iter_XXXXXXX directory of {load})"
        raise ConversionError(f"{flag} {load}: {path} is damaged: {'; '.join(problems)}; use an intact "
                              f"checkpoint{older}, or {skip_hint}")


def read_glm5_entry(path: str, reader: TorchDistReader) -> ModelRecord:
    """The checkpoint's "glm5" record (checkpoint/format.py ``read_record``: ``mtp`` known), from its common state."""
    return reader.record()


@dataclass
class ExportItem:
    out: OutTensor
    key: str  # checkpoint key
    block: Callable  # (r0, r1) -> (offsets, sizes)


def plan_export(cfg: GLM5Config, reader: TorchDistReader, include_mtp: bool, dtype: Optional[torch.dtype],
                where: str) -> list[ExportItem]:
    items = []
    for row in conversion_plan(cfg, include_mtp=include_mtp):
        state_key = row.tied_to if row.kind == "tied" else row.mcore
        key = mcore_checkpoint_key(state_key)
        if key not in reader:
            raise ConversionError(f"{where}: the checkpoint lacks {key} (needed for {row.hf[0]})")
        shapes = hf_shapes_from_mcore(row, reader.shape(key))
        stored = reader.dtype(key)
        out_dtype = stored if dtype is None else dtype
        if state_key.endswith("mlp.router.expert_bias"):
            out_dtype = torch.float32  # e_score_correction_bias is fp32 in every GLM-5 checkpoint
        for hf_key, shape, placement in zip(row.hf, shapes, hf_placements(row, shapes)):
            items.append(ExportItem(OutTensor(hf_key, out_dtype, tuple(shape)), key,
                                    partial(placement.mcore_block, shape)))
    return items


def _generation_config(cfg: GLM5Config) -> dict:
    out = {"_from_model_config": True}
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = getattr(cfg, k)
        if v is not None:
            out[k] = v
    return out


def tokenizer_dir(flag: str) -> str:
    if flag == "tiny":
        from megatron_glm5.arguments import asset_path
        return asset_path("tokenizer")
    if not os.path.isdir(flag):
        raise ConversionError(f"--tokenizer {flag}: no such directory")
    if not any(os.path.isfile(os.path.join(flag, n)) for n in TOKENIZER_FILES):
        raise ConversionError(f"--tokenizer {flag}: no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...)")
    return flag


def convert_megatron_to_hf(load: str, save: str, dtype: str = "auto", max_shard_size="5GB",
                           tokenizer: Optional[str] = None, overwrite: bool = False, progress: bool = True,
                           max_block_bytes: int = DEFAULT_CHUNK_BYTES, mtp: Optional[bool] = None,
                           verify: bool = True, workers: int = 1, wrap_reader: Optional[Callable] = None) -> dict:
    """torch_dist checkpoint (training or converted) -> HF directory ``save``. Returns a summary dict.
    ``wrap_reader(reader, cfg)``: the reader the export reads through (--merge-lora: lora/export.py's merging one).
    ``workers``: processes writing disjoint shares of the tensors (parallel.py; same output for every value).

    ``verify``: check the checkpoint against its manifest first (``resolve_checkpoint_dir``). ``mtp``: write the
    MTP layer (default: when the checkpoint has it; False leaves it out, as transformers' own models have none)."""
    t0 = time.time()
    final = _check_target(save, overwrite)
    runner = Runner(workers)
    out_dtype = dtype_from_flag(dtype)
    try:
        max_shard = parse_size(max_shard_size)
    except ValueError:
        raise ConversionError(f"--max-shard-size {max_shard_size}: expected e.g. 5GB, 500MB or a byte count") from None
    tok_dir = tokenizer_dir(tokenizer) if tokenizer else None
    if not verify:
        log.warning("--no-verify: the checkpoint is not checked against its manifest (damaged files are exported "
                    "as they are)")
    path = resolve_checkpoint_dir(load, verify=verify)
    reader = TorchDistReader(path)
    entry = read_glm5_entry(path, reader)
    try:
        cfg = GLM5Config.from_hf(entry.model_config)
    except ConfigError as e:
        raise ConversionError(f"{path}: recorded model config is invalid: {e}") from None
    if wrap_reader is not None:  # --merge-lora: base + (alpha/r) B A, block by block
        if workers > 1:
            raise ConversionError("--merge-lora writes with one worker: leave out --workers")
        reader = wrap_reader(reader, cfg)
    has_mtp = bool(cfg.num_nextn_predict_layers) and bool(entry.mtp)
    if mtp and not has_mtp:
        raise ConversionError(f"--mtp: {path} has no MTP layer (it was converted or trained without one); export "
                              "without --mtp")
    include_mtp = has_mtp if mtp is None else bool(mtp)
    items = plan_export(cfg, reader, include_mtp, out_dtype, path)
    items, fp8_plan = fp8_io.plan_fp8_export(cfg, reader, include_mtp, out_dtype, items, ExportItem, path)
    by_name = {it.out.name: it for it in items}
    shards = plan_shards([it.out for it in items], max_shard)
    total = sum(it.out.nbytes for it in items)
    used = {it.key for it in items}
    ignored = [k for k in reader.tensor_keys() if k not in used and "optimizer." not in k  # optimizer: never read
               and not (not include_mtp and k.startswith("mtp."))]  # MTP left out on purpose (--no-mtp)
    if ignored:
        log.warning("%s: %d model tensor(s) not in the GLM-5 table were not exported, e.g. %s", path, len(ignored),
                    ignored[0])
    partial_dir = final + ".partial"
    files, jobs, weight_map = export_layout(partial_dir, shards, lambda n_: (by_name[n_].key, by_name[n_].block),
                                            path, max_block_bytes)
    jobs = fp8_io.fp8_export_jobs(jobs, fp8_plan)  # FP8: quantised / dequantised tensors
    runner.prepare(partial(_fresh_dir, partial_dir))
    bar = _progress(total, "torch_dist -> HF", progress and runner.is_coordinator)
    t_write = time.time()
    try:
        runner.prepare(partial(create_shard_files, files))
        runner.run(jobs, on_bytes=bar.update, marker_dir=partial_dir, resources={("torch_dist", path): reader})
        jobs.clear()

        def small_files():  # rank 0: index, config, generation config, tokenizer; then the rename
            _write_json(os.path.join(partial_dir, "model.safetensors.index.json"),
                        {"metadata": {"total_size": total}, "weight_map": weight_map})
            hf_config = cfg.to_hf()
            if out_dtype is not None and out_dtype not in FP8_DTYPES:
                hf_config["dtype"] = _HF_DTYPE_STR[out_dtype]
                if "torch_dtype" in hf_config:
                    hf_config["torch_dtype"] = _HF_DTYPE_STR[out_dtype]
            _write_json(os.path.join(partial_dir, "config.json"), fp8_io.export_hf_config(hf_config, fp8_plan))
            gen = next((p for p in (os.path.join(path, "generation_config.json"),
                                    os.path.join(os.path.dirname(os.path.abspath(path)), "generation_config.json"))
                        if os.path.isfile(p)), None)
            if gen:
                shutil.copyfile(gen, os.path.join(partial_dir, "generation_config.json"))
            else:
                _write_json(os.path.join(partial_dir, "generation_config.json"), _generation_config(cfg))
            if tok_dir:
                for n_ in TOKENIZER_FILES:
                    if os.path.isfile(os.path.join(tok_dir, n_)):
                        shutil.copyfile(os.path.join(tok_dir, n_), os.path.join(partial_dir, n_))
            _replace_dir(partial_dir, final)

        runner.prepare(small_files)
    except BaseException:
        if runner.is_coordinator:
            shutil.rmtree(partial_dir, ignore_errors=True)
        raise
    finally:
        bar.close()
        reader.close()
    seconds = time.time() - t0
    return {"direction": "megatron_to_hf", "output": final, "bytes": total, "seconds": seconds,
            "write_seconds": time.time() - t_write,
            "mb_per_s": total / 2 ** 20 / max(seconds, 1e-9), "peak_rss_bytes": peak_rss_bytes(),
            "tensors": len(items), "shards": len(shards), "mtp": include_mtp, "source": path,
            "workers": runner.used_workers, "worker_peak_rss_bytes": runner.worker_peak_rss}
