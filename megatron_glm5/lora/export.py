"""Adapters out of megatron-glm5: a PEFT directory for transformers' GlmMoeDsaForCausalLM, or merged into the base.

PEFT (``tools/convert_megatron_to_hf.py --load ADAPTER_CHECKPOINT --save OUT``): adapter_config.json and
adapter_model.safetensors that ``peft.PeftModel.from_pretrained`` loads onto GlmMoeDsaForCausalLM. HF module names
come from the one table (conversion/hf_mapping.py). The attention projections are PEFT ``target_modules``; the
routed experts, fused 3-D parameters in transformers 5 (``mlp.experts.gate_up_proj`` [E, 2I, H] and
``mlp.experts.down_proj`` [E, H, I]), are PEFT ``target_parameters`` (its ParamWrapper: lora_A [E*r, in] expert-
major, lora_B [out, r*E] rank-major; with both targeted, gate_up_proj's wrapper is the inner ``base_layer``). The
dense MLPs' and the shared expert's gate/up/down cannot be expressed: peft 0.21 rewrites every ``*.gate_proj`` /
``up_proj`` / ``down_proj`` target of a glm_moe_dsa model into the routed experts' fused parameters, so an adapter
checkpoint with those targets is exported merged (``--merge-lora``) instead; the exporter says so in one line.

Merged (``--load BASE --merge-lora ADAPTER_CHECKPOINT``): the existing HF exporter streams the base, every block of
an adapted weight read as base + (alpha/r) B A (computed in fp32 for the block's rows only), written in the
export dtype (bf16 by default for a bf16 base).
"""
from __future__ import annotations

import json
import logging
import os

import torch

from megatron_glm5.checkpoint.format import COMMON_KEY as CKPT_COMMON_KEY, model_fingerprint
from megatron_glm5.errors import UserError
from megatron_glm5.fp8.blocks import FP8_DTYPE, SCALE_SUFFIX, dequantize_region
from megatron_glm5.lora.checkpoint import COMMON_KEY
from megatron_glm5.lora.config import LoRAConfig

log = logging.getLogger("megatron_glm5.lora")
PEFT_PREFIX = "base_model.model."
NOT_PEFT = ("gate_up", "down", "shared_gate_up", "shared_down")


class LoRAExportError(UserError):
    """An adapter checkpoint that cannot be exported as asked."""


def lora_record(reader):
    """The ``glm5_lora`` record of a torch_dist checkpoint (conversion/torch_dist_stream.TorchDistReader), or None."""
    if not reader.has_object(CKPT_COMMON_KEY):
        return None
    common = reader.read_object(CKPT_COMMON_KEY)
    common = common[0] if isinstance(common, list) and common else common  # as checkpoint/format.read_record
    return common.get(COMMON_KEY) if isinstance(common, dict) else None


def is_adapter_checkpoint(load: str) -> bool:
    """Whether --load names a LoRA adapter checkpoint (read without verification: the export verifies)."""
    from megatron_glm5.conversion.convert import resolve_checkpoint_dir
    from megatron_glm5.conversion.torch_dist_stream import TorchDistReader

    return lora_record(TorchDistReader(resolve_checkpoint_dir(load, verify=False))) is not None


def peft_dtype(flag: str):
    """--dtype of the exporter for PEFT adapters: auto keeps the stored dtype."""
    choices = {"auto": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if flag not in choices:
        raise LoRAExportError(f"--dtype {flag}: adapters are written in bf16, fp16 or fp32 (or auto: as stored)")
    return choices[flag]


def read_adapters(reader) -> dict:
    """{checkpoint key: full tensor} of the adapter tensors (lora_*) of an adapter checkpoint."""
    out = {}
    for key in reader.tensor_keys():
        if ".optimizer." in key or key.startswith("optimizer.") or not key.rsplit(".", 1)[-1].startswith("lora_"):
            continue
        shape = reader.shape(key)
        out[key] = reader.read_region(key, (0,) * len(shape), shape)
    return out


def _module_rows(cfg) -> dict:
    from megatron_glm5.conversion.hf_mapping import conversion_plan

    return {row.mcore: row for row in conversion_plan(cfg, include_mtp=False) if row.mcore}


def peft_state(cfg, lora: LoRAConfig, adapters: dict):
    """(PEFT state dict, target_modules, target_parameters) of the adapters (transformers' names)."""
    bad = [t for t in lora.targets if t in NOT_PEFT]
    if bad:
        raise LoRAExportError(
            f"adapters on {', '.join(bad)} cannot be written for PEFT (peft 0.21 retargets every gate_proj/up_proj/"
            "down_proj of GLM-5 to the routed experts): export the merged model with --merge-lora instead")
    rows = _module_rows(cfg)
    state, modules, params = {}, [], []
    e = cfg.n_routed_experts
    by_module = {}
    for key, t in adapters.items():
        module, name = key.rsplit(".", 1)
        by_module.setdefault(module, {})[name] = t
    for module, ts in sorted(by_module.items()):
        if "lora_a" in ts:  # an attention projection: one HF module
            hf = rows[module + ".weight"].hf[0][: -len(".weight")]
            state[f"{PEFT_PREFIX}{hf}.lora_A.weight"] = ts["lora_a"]
            state[f"{PEFT_PREFIX}{hf}.lora_B.weight"] = ts["lora_b"]
            modules.append(hf)
            continue
        experts = rows[module + ".weight1"].hf[0].rsplit(".", 3)[0]  # model.layers.{i}.mlp.experts
        both = "lora_a1" in ts and "lora_a2" in ts
        for which, param in (("1", "gate_up_proj"), ("2", "down_proj")):
            if "lora_a" + which not in ts:
                continue
            a, b = ts["lora_a" + which], ts["lora_b" + which]  # [E, r, in], [E, out, r]
            inner = ".base_layer" if both and which == "1" else ""
            state[f"{PEFT_PREFIX}{experts}{inner}.lora_A.weight"] = a.reshape(e * lora.rank, a.shape[-1]).contiguous()
            state[f"{PEFT_PREFIX}{experts}{inner}.lora_B.weight"] = b.permute(1, 2, 0).reshape(
                b.shape[1], lora.rank * e).contiguous()
            params.append(f"{experts}.{param}")
    return state, modules, params


def write_peft(load: str, save: str, dtype=None, overwrite: bool = False) -> dict:
    """Adapter checkpoint ``load`` -> PEFT directory ``save``. Returns a summary."""
    from safetensors.torch import save_file

    from megatron_glm5.config import GLM5Config
    from megatron_glm5.conversion.convert import resolve_checkpoint_dir
    from megatron_glm5.conversion.torch_dist_stream import TorchDistReader

    path = resolve_checkpoint_dir(load, verify=True)
    reader = TorchDistReader(path)
    record = lora_record(reader)
    if record is None:
        raise LoRAExportError(f"--load {load}: not a LoRA adapter checkpoint (no {COMMON_KEY} record)")
    cfg = GLM5Config.from_hf(reader.record().model_config)
    lora = LoRAConfig.from_record(record["lora"])
    if lora.train_indexer:
        log.warning("%s: the indexers were trained (--train-indexer); PEFT holds adapters only: export the merged "
                    "model (--merge-lora) to keep the trained indexers", path)
    state, modules, params = peft_state(cfg, lora, read_adapters(reader))
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    if os.path.exists(save) and not overwrite:
        raise LoRAExportError(f"--save {save} exists; choose another directory or pass --overwrite")
    os.makedirs(save, exist_ok=True)
    save_file(state, os.path.join(save, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
              # PEFT's 3-D expert adapters refuse dropout; dropout is a training-time setting only
              "lora_dropout": 0.0 if params else lora.dropout, "bias": "none", "fan_in_fan_out": False,
              "target_modules": modules, "target_parameters": params or None, "base_model_name_or_path": None,
              "inference_mode": True}
    with open(os.path.join(save, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    log.info("wrote PEFT adapters to %s: %d modules, %d expert parameters, rank %d", save, len(modules), len(params),
             lora.rank)
    return {"save": save, "tensors": len(state), "target_modules": len(modules), "target_parameters": len(params)}


class MergingReader:
    """A TorchDistReader of the base whose adapted weights read as base + (alpha/r) B A (``--merge-lora``).

    An adapted weight stored in FP8 (a ``--base-precision fp8`` base) reads as bf16: its e4m3 values times their
    block scales, plus the product, in fp32, rounded once; its scales are no longer listed (the exporter then
    quantises the merged weight again for an FP8 export, or writes it as it is for ``--dtype bf16/fp32``)."""

    def __init__(self, reader, adapters: dict, lora: LoRAConfig):
        self._reader, self._scaling = reader, lora.scaling
        self._adapters = adapters
        modules = {k.rsplit(".", 1)[0] for k in adapters}
        self._fp8_merged = {  # adapted FP8 weight -> its scale key
            k: k + SCALE_SUFFIX for k in reader.tensor_keys()
            if reader.dtype(k) == FP8_DTYPE and (k + SCALE_SUFFIX) in reader
            and k.rsplit(".", 1)[0] in modules and k.rsplit(".", 1)[1] in ("weight", "weight1", "weight2")
            and self._pair(k.rsplit(".", 1)[0], k.rsplit(".", 1)[1][6:]) is not None}
        self._hidden = set(self._fp8_merged.values())

    def __getattr__(self, name):
        return getattr(self._reader, name)

    def __contains__(self, key):
        return key in self._reader and key not in self._hidden

    def tensor_keys(self) -> list:
        return [k for k in self._reader.tensor_keys() if k not in self._hidden]

    def dtype(self, key: str):
        return torch.bfloat16 if key in self._fp8_merged else self._reader.dtype(key)

    def _read_fp8(self, key: str, offsets, sizes) -> torch.Tensor:
        scale_key = self._fp8_merged[key]
        keys = {"weight": key, "scale": scale_key}
        # a gated MLP's fc1 [gate; up] holds a block grid per half (fp8/modules.py FP8GatedColumnParallelLinear)
        groups = 2 if key.endswith("linear_fc1.weight") else 1
        return dequantize_region(lambda which, o, s: self._reader.read_region(keys[which], o, s),
                                 self._reader.shape(key), self._reader.shape(scale_key), offsets, sizes, groups)

    def _pair(self, module: str, which: str = ""):
        a = self._adapters.get(f"{module}.lora_a{which}")
        return (a, self._adapters[f"{module}.lora_b{which}"]) if a is not None else None

    def _delta(self, key: str, offsets, sizes):
        module, name = key.rsplit(".", 1)
        if name == "weight":
            pair = self._pair(module)
            if pair is None:
                return None
            a, b = pair
            (o0, i0), (n, m) = offsets, sizes
            return (b[o0:o0 + n].float() @ a[:, i0:i0 + m].float()) * self._scaling
        if name not in ("weight1", "weight2"):
            return None
        pair = self._pair(module, name[-1])
        if pair is None:
            return None
        a, b = pair
        e0, ne = offsets[0], sizes[0]
        d = torch.bmm(b[e0:e0 + ne].float(), a[e0:e0 + ne].float()) * self._scaling  # [ne, out, in]
        if name == "weight1":
            d = d.view(ne, 2, -1, d.shape[-1])
        return d[(slice(None),) + tuple(slice(o, o + s) for o, s in zip(offsets[1:], sizes[1:]))]

    def read_region(self, key: str, offsets, sizes) -> torch.Tensor:
        if key in self._fp8_merged:
            base = self._read_fp8(key, tuple(offsets), tuple(sizes))
            return (base + self._delta(key, tuple(offsets), tuple(sizes))).to(torch.bfloat16)
        base = self._reader.read_region(key, offsets, sizes)
        delta = self._delta(key, tuple(offsets), tuple(sizes))
        if delta is None:
            return base
        return (base.float() + delta).to(base.dtype)


def merging_reader(reader, adapter_dir: str, base_cfg):
    """``reader`` (of the base) merged with the adapter checkpoint ``adapter_dir``; refuses another base."""
    from megatron_glm5.conversion.convert import resolve_checkpoint_dir
    from megatron_glm5.conversion.torch_dist_stream import TorchDistReader

    path = resolve_checkpoint_dir(adapter_dir, verify=True, flag="--merge-lora")
    adapters_reader = TorchDistReader(path)
    record = lora_record(adapters_reader)
    if record is None:
        raise LoRAExportError(f"--merge-lora {adapter_dir}: not a LoRA adapter checkpoint (no {COMMON_KEY} record)")
    saved, mine = record["base"].get("model_fingerprint"), model_fingerprint(base_cfg)
    if saved is not None and saved != mine:
        raise LoRAExportError(f"--merge-lora {adapter_dir}: these adapters were trained on the base with model "
                              f"fingerprint {saved}, but --load has {mine}; merge them into their own base")
    return MergingReader(reader, read_adapters(adapters_reader), LoRAConfig.from_record(record["lora"]))


def merge_into(adapter_dir: str):
    """The exporter's ``wrap_reader`` for --merge-lora ADAPTERS (conversion/convert.py convert_megatron_to_hf)."""
    return lambda reader, base_cfg: merging_reader(reader, adapter_dir, base_cfg)
