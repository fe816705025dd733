"""GLM-5 model hyper-parameters: one dataclass with Hugging Face semantics, and its megatron-core mapping.

:class:`GLM5Config` is the single source of model hyper-parameters in this project.  Its fields mirror
``transformers.GlmMoeDsaConfig`` (the ``glm_moe_dsa`` model type), read from / written to a ``config.json`` with
:meth:`GLM5Config.from_hf` / :meth:`GLM5Config.to_hf` (an exact round trip), and
:meth:`GLM5Config.to_transformer_config` turns it into a megatron-core ``MLATransformerConfig`` subclass
(:class:`GLM5TransformerConfig`, built lazily so that importing this module does not import megatron.core).

Presets (``GLM5Config.from_preset(name)``)
-----------------------------------------

===================  ======  ======  ======  =====  ===========  ==========  =========  =================  ===============
name                 vocab   hidden  layers  heads  experts      rope_theta  max_pos    indexers           params, no MTP
===================  ======  ======  ======  =====  ===========  ==========  =========  =================  ===============
``glm5``             154880  6144    78      64     256, top-8   1e6         202752     78 F               743,911,199,232
``glm5.1``           = glm5
``glm5.2``           154880  6144    78      64     256, top-8   8e6         1048576    21 F + 57 S        743,377,000,704
``glm5.3``           = glm5.2
``tiny``             512     64      4       4      8, top-2     1e4         4096       F F F F            322,944
``tiny-indexshare``  512     64      4       4      8, top-2     1e4         4096       F S F S            316,224
``tiny-groups``      512     64      4       4      8, top-2     1e4         4096       F F F F            322,944
===================  ======  ======  ======  =====  ===========  ==========  =========  =================  ===============

All real presets share: first 3 layers dense (intermediate 12288), q_lora_rank 2048, kv_lora_rank 512,
qk_nope 192 + qk_rope 64, v_head_dim 256, 1 shared expert, moe_intermediate 2048, routed_scaling_factor 2.5,
n_group 1 / topk_group 1, indexer 32 heads x 128 dims with index_topk 2048, rms_norm_eps 1e-5, untied lm_head,
eos [154820, 154827, 154829], pad 154820.  GLM-5.2/5.3 add IndexShare (``index_topk_freq`` 4,
``index_skip_topk_offset`` 3: layers 0, 1, 2, 6, 10, ..., 74 are full), ``index_share_for_mtp_iteration`` true,
``moe_router_dtype`` "float32" and the misleading ``head_dim: 192`` key (kept in the emitted config.json, never
used for a width).  The tiny presets: 4 layers (first 1 dense, intermediate 128), q_lora 32, kv_lora 16,
qk_nope 16 + qk_rope 8, v 16, 8 experts top-2 (moe_intermediate 32, 1 shared expert), indexer 4 heads x 16 dims,
index_topk 16, pad 0, 1 MTP layer; ``tiny-groups`` uses n_group 2 / topk_group 1 (group-limited routing),
``tiny-indexshare`` also sets index_share_for_mtp_iteration and moe_router_dtype float32 like GLM-5.2/5.3.

Parameter counts
----------------
:meth:`GLM5Config.count_parameters` equals ``sum(p.numel() for p in GlmMoeDsaForCausalLM(cfg).parameters())``:
the router's ``e_score_correction_bias`` is a *buffer* in transformers (megatron's ``router.expert_bias`` too)
and is not counted unless ``include_buffers=True``.  ``include_mtp=True`` adds the MTP block(s): per MTP layer
one full decoder layer (MoE MLP, with its own indexer), ``eh_proj`` [hidden, 2*hidden], ``enorm``, ``hnorm`` and
``shared_head.norm``.  The MTP ``embed_tokens`` / ``shared_head.head`` are tied to the main embedding and output
layer in megatron, so they are not counted (on disk they are stored again under ``model.layers.78.*``).
For GLM-5.2/5.3 the MTP extra is 9,952,920,320 parameters.

IndexShare
----------
``indexer_types[i]`` is ``"full"`` (layer i has its own indexer and computes the top-k) or ``"shared"`` (no indexer
weights; reuses the top-k of the nearest earlier full layer, see :meth:`GLM5Config.index_source_layer`).
:meth:`GLM5Config.from_hf` resolves it exactly like transformers: explicit ``indexer_types``, else
``index_topk_pattern`` (an ``"F"``/``"S"`` string or a list), else layer i is full iff
``max(i - index_skip_topk_offset + 1, 0) % index_topk_freq == 0`` (defaults 1 and 2: all full).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

# GLM5TransformerConfig is importable by name (module __getattr__) but kept out of __all__ so that
# `from megatron_glm5.config import *` does not import megatron.core.
__all__ = [
    "ConfigError",
    "GLM5Config",
    "PRESETS",
    "transformer_config_class",
]

MODEL_TYPE = "glm_moe_dsa"
ARCHITECTURE = "GlmMoeDsaForCausalLM"
_ACCEPTED_ARCHITECTURES = ("GlmMoeDsaForCausalLM", "GlmMoeDsaModel")
INDEXER_TYPES = ("full", "shared")
MLP_LAYER_TYPES = ("dense", "sparse")
DSA_STAGES = ("dense-warmup", "sparse")  # --dsa-stage choices, in training order


class ConfigError(ValueError):
    """An invalid GLM-5 configuration.  ``field`` names the offending field (when there is one)."""

    def __init__(self, message: str, field: Optional[str] = None):
        super().__init__(message)
        self.field = field


# --------------------------------------------------------------------------------------------------------------
# HF config.json <-> fields
# --------------------------------------------------------------------------------------------------------------

# Each GLM5Config field is declared once, in the dataclass below: its default (transformers' GlmMoeDsaConfig
# default, so that a partial config.json resolves to what transformers would build; for the GLM-specific keys
# transformers does not model -- num_nextn_predict_layers, index_share_for_mtp_iteration, moe_router_dtype --
# absent means off) and, in its metadata (see _field), how config.json stores it, its range check and the
# GLM5TransformerConfig field it becomes.  The tables below the class (_HF_DEFAULTS, _SIMPLE_KEYS, _CHECKED,
# _MCORE_FIELDS) are derived from those declarations.
_RANGE_CHECKS: Dict[str, Callable[[Any], bool]] = {  # check name (the error's wording) -> test, in checking order
    "positive integer": lambda v: _is_int(v) and v > 0,
    "non-negative integer": lambda v: _is_int(v) and v >= 0,
    "positive number": lambda v: _is_number(v) and v > 0,
    "non-negative number": lambda v: _is_number(v) and v >= 0,
}


def _field(default: Any, *, check: Optional[str] = None, hf: Optional[str] = "same",
           hf_aliases: Tuple[str, ...] = (), hf_omit_none: bool = False, mcore: Optional[str] = None,
           mcore_type: Optional[type] = None, arch: bool = False, required: Union[bool, str] = False, doc: str = "",
           **kw: Any):
    """A GLM5Config field with its metadata (a field declared without it is a plain config.json key, no check).

    ``check``: a key of _RANGE_CHECKS (an integer size > 0 is "positive integer").  ``hf``: "same" (stored under
    the field's name, missing means the default), "special" (rope_theta, the per-layer lists: from_hf / to_hf
    handle them by name) or None (not a config.json key: ``raw``).  ``hf_aliases``: older key names read too (a
    later one wins), dropped when the field is written.  ``hf_omit_none``: None is written as an absent key.
    ``arch``: the field shapes the weights, so a checkpoint and the model it is loaded into must agree on it
    (ARCH_FIELDS).  ``mcore``: the GLM5TransformerConfig field (one megatron-core's MLATransformerConfig lacks)
    that carries the value, converted by ``mcore_type``, documented by ``doc``; the fields megatron-core has are
    mapped in :meth:`GLM5Config.to_transformer_config`.  ``required``: a config.json (:meth:`GLM5Config.from_hf`)
    must state the field (under its name or an alias; a string names another key that stands in for it): its
    transformers default is GLM-5's own size or hyper-parameter, not a value that fits another checkpoint
    (REQUIRED_HF_FIELDS; presets and direct construction are not affected).
    """
    if check is not None and check not in _RANGE_CHECKS:
        raise ValueError(f"unknown check {check!r}")
    meta = dict(check=check, hf=hf, hf_aliases=hf_aliases, hf_omit_none=hf_omit_none, mcore=mcore,
                mcore_type=mcore_type, arch=arch, required=required, doc=doc)
    return field(default=default, metadata=meta, **kw)


def _meta(f: dataclasses.Field, key: str) -> Any:
    return f.metadata.get(key, {"hf": "same", "hf_aliases": (), "required": False}.get(key))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _freq_offset_indexer_types(num_layers: int, freq: Any, offset: Any) -> List[str]:
    """transformers' schedule: layer i is full iff max(i - offset + 1, 0) % freq == 0."""
    freq = 1 if freq is None else freq
    offset = 2 if offset is None else offset
    if not _is_int(freq) or not _is_int(offset):
        raise ConfigError(
            f"index_topk_freq / index_skip_topk_offset must be integers, got {freq!r} / {offset!r}",
            field="index_topk_freq",
        )
    freq = max(freq, 1)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]


def _pattern_indexer_types(pattern: Any) -> List[str]:
    if isinstance(pattern, str):
        table = {"F": "full", "S": "shared"}
        bad = sorted({c for c in pattern if c not in table})
        if bad:
            raise ConfigError(
                f"index_topk_pattern may only hold 'F' and 'S', found {', '.join(map(repr, bad))}",
                field="index_topk_pattern",
            )
        return [table[c] for c in pattern]
    if isinstance(pattern, (list, tuple)):
        return list(pattern)
    raise ConfigError(
        f"index_topk_pattern must be a string of F/S or a list, got {type(pattern).__name__}",
        field="index_topk_pattern",
    )


def _resolve_indexer_types(d: Mapping[str, Any], num_layers: int) -> List[str]:
    """Per-layer indexer types from a config.json dict, in transformers' order of precedence."""
    explicit = d.get("indexer_types")
    if explicit is not None:
        if not isinstance(explicit, (list, tuple)):
            raise ConfigError(
                f"indexer_types must be a list, got {type(explicit).__name__}", field="indexer_types"
            )
        return list(explicit)
    pattern = d.get("index_topk_pattern")
    if pattern is not None:
        return _pattern_indexer_types(pattern)
    return _freq_offset_indexer_types(num_layers, d.get("index_topk_freq"), d.get("index_skip_topk_offset"))


def _check_indexer_types(types: Sequence[str], n: int, name: str, n_name: str) -> None:
    """The per-layer indexer types: ``n`` of them, each "full" or "shared", layer 0 full."""
    if len(types) != n:
        raise ConfigError(f"len({name}) is {len(types)}, {n_name} is {n}", field=name)
    bad = sorted({t for t in types if t not in INDEXER_TYPES}, key=str)
    if bad:
        raise ConfigError(
            f"{name}: unknown indexer type(s) {', '.join(map(repr, bad))} (expected 'full' or 'shared')", field=name
        )
    if types and types[0] != "full":
        raise ConfigError(
            f"{name}: layer 0 is 'shared' but there is no earlier full layer to share the top-k of", field=name
        )


def _index_source_layer(types: Sequence[str], i: int) -> int:
    """0-based index of the layer whose top-k layer ``i`` uses: the nearest full layer <= i."""
    for j in range(i, -1, -1):
        if types[j] == "full":
            return j
    raise ConfigError(f"layer {i} is 'shared' but no earlier layer is 'full'", field="indexer_types")


def check_cp_seq_length(seq_length: int, cp: int) -> None:
    """--seq-length against --cp: the load-balanced context-parallel split cuts every sequence into 2 * cp equal
    chunks (model/context_parallel.py).  The one check of the flags; validate_args and validate_layout call it."""
    if cp > 1 and seq_length % (2 * cp):
        raise ConfigError(
            f"--seq-length {seq_length} is not divisible by 2 x --cp {cp} = {2 * cp} (load-balanced context-parallel "
            "split)",
            field="seq_length",
        )


def _dense_first_mlp_types(num_layers: int, first_k_dense: int) -> List[str]:
    n_dense = min(max(first_k_dense, 0), num_layers) if _is_int(first_k_dense) else 0
    return ["dense"] * n_dense + ["sparse"] * (num_layers - n_dense)


def _check_identity(d: Mapping[str, Any], src: str) -> None:
    mt = d.get("model_type")
    if mt is not None and mt != MODEL_TYPE:
        raise ConfigError(f"{src}: model_type is {mt!r}, expected {MODEL_TYPE!r}", field="model_type")
    archs = d.get("architectures")
    if archs:
        archs = [archs] if isinstance(archs, str) else list(archs)
        bad = [a for a in archs if a not in _ACCEPTED_ARCHITECTURES]
        if bad:
            raise ConfigError(
                f"{src}: architectures {archs!r} is not {ARCHITECTURE!r}", field="architectures"
            )


def _hf_keys_of(f: dataclasses.Field) -> Tuple[str, ...]:
    """The config.json keys that state field ``f`` (its name, its aliases, the key standing in for it)."""
    if f.name == "rope_theta":
        return ("rope_parameters.rope_theta", "rope_theta")
    stand_in = _meta(f, "required")
    return (f.name, *_meta(f, "hf_aliases"), *((stand_in,) if isinstance(stand_in, str) else ()))


def _hf_states(d: Mapping[str, Any], key: str) -> bool:
    if key == "rope_parameters.rope_theta":
        rp = d.get("rope_parameters")
        return isinstance(rp, Mapping) and rp.get("rope_theta") is not None
    return key in d


def _check_required(d: Mapping[str, Any], src: str) -> None:
    """Every REQUIRED_HF_FIELDS field is stated: absent, transformers would give it GLM-5's full-size value."""
    missing = [f.name for f in _FIELDS if f.name in REQUIRED_HF_FIELDS
               and not any(_hf_states(d, k) for k in _hf_keys_of(f))]
    if missing:
        many = len(missing) > 1
        raise ConfigError(
            f"{src}: missing required field{'s' if many else ''} {', '.join(missing)} (not assumed to be GLM-5's "
            f"{', '.join(str(_DEFAULTS[m]) for m in missing)}); add {'them' if many else 'it'} (a config.json saved "
            "by transformers has them all) or use --preset",
            field=missing[0],
        )


def _fields_from_hf_dict(d: Mapping[str, Any], src: str) -> Dict[str, Any]:
    """Map a config.json dict to GLM5Config constructor arguments (without validation of values)."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"{src}: a config must be a JSON object, got {type(d).__name__}")
    _check_identity(d, src)
    _check_required(d, src)
    out: Dict[str, Any] = {}
    for key in _SIMPLE_KEYS:
        out[key] = copy.deepcopy(d.get(key, _HF_DEFAULTS[key]))
        for alias in _HF_ALIASES.get(key, ()):  # backward-compatible names transformers honours; the last one wins
            if d.get(alias) is not None:
                out[key] = d[alias]

    rp = d.get("rope_parameters")
    if rp is not None and not isinstance(rp, Mapping):
        raise ConfigError(f"{src}: rope_parameters must be an object", field="rope_parameters")
    rope_type = (rp or {}).get("rope_type", "default")
    if rope_type not in (None, "default"):
        raise ConfigError(
            f"{src}: rope_parameters.rope_type {rope_type!r} is not supported (GLM-5 uses plain RoPE)",
            field="rope_parameters",
        )
    if d.get("rope_scaling"):
        raise ConfigError(f"{src}: rope_scaling is not supported (GLM-5 uses plain RoPE)", field="rope_scaling")
    if rp is not None and rp.get("rope_theta") is not None:
        out["rope_theta"] = rp["rope_theta"]
    elif d.get("rope_theta") is not None:
        out["rope_theta"] = d["rope_theta"]
    else:
        out["rope_theta"] = _DEFAULTS["rope_theta"]

    try:
        out["indexer_types"] = _resolve_indexer_types(d, out["num_hidden_layers"])
    except ConfigError as e:
        raise ConfigError(f"{src}: {e}", field=e.field) from None
    mlp = d.get("mlp_layer_types")
    out["mlp_layer_types"] = list(mlp) if isinstance(mlp, (list, tuple)) else mlp
    # NOTE: the `head_dim` key is deliberately ignored (GLM-5.2/5.3 carry head_dim 192, not a real width).
    return out


def _load_hf_dict(src: Any) -> Tuple[dict, str]:
    if isinstance(src, Mapping):
        return dict(src), "<dict>"
    if hasattr(src, "to_dict") and not isinstance(src, (str, bytes, os.PathLike)):
        return src.to_dict(), f"<{type(src).__name__}>"
    if isinstance(src, (str, os.PathLike)):
        path = os.fspath(src)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no config.json at {path}")
        try:
            with open(path, "r", encoding="utf-8") as f:
                d = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{path}: a config must be a JSON object, got {type(d).__name__}")
        return d, path
    raise TypeError(f"from_hf expects a directory, a json file path or a dict, got {type(src).__name__}")


# --------------------------------------------------------------------------------------------------------------
# GLM5Config
# --------------------------------------------------------------------------------------------------------------


@dataclass
class GLM5Config:
    """GLM-5 family hyper-parameters, with transformers' ``GlmMoeDsaConfig`` semantics.

    Defaults equal transformers' defaults, so ``GLM5Config(**kw)`` resolves like ``GlmMoeDsaConfig(**kw)``.
    ``mlp_layer_types=None`` derives ``first_k_dense_replace`` dense layers then MoE; ``indexer_types=None`` means
    every layer has its own indexer.  ``raw`` is the config.json dict this config was read from (``None`` when
    constructed directly); :meth:`to_hf` uses it as a base and writes back only what the fields changed.
    Use :meth:`replace` (rather than ``dataclasses.replace``) to change ``num_hidden_layers`` /
    ``first_k_dense_replace``: it re-derives the per-layer lists.
    """

    # arch=True: the field shapes the weights (a checkpoint must agree on it); mcore=: see _field
    vocab_size: int = _field(154880, check="positive integer", arch=True, required=True, mcore="vocab_size",
                             doc="Vocabulary size (unpadded).")
    hidden_size: int = _field(6144, check="positive integer", arch=True, required=True)
    intermediate_size: int = _field(12288, check="positive integer", arch=True, required=True)
    moe_intermediate_size: int = _field(2048, check="positive integer", arch=True, required=True)
    num_hidden_layers: int = _field(78, check="positive integer", arch=True, required=True)
    num_attention_heads: int = _field(64, check="positive integer", arch=True, required=True)
    num_key_value_heads: int = _field(64, check="positive integer", required=True)
    n_shared_experts: int = _field(1, check="non-negative integer", arch=True, required=True)
    # num_experts wins over num_local_experts, as in GlmMoeDsaConfig.__post_init__
    n_routed_experts: int = _field(256, check="positive integer", arch=True, required=True,
                                   hf_aliases=("num_local_experts", "num_experts"))
    routed_scaling_factor: float = _field(2.5, check="positive number", required=True)
    kv_lora_rank: int = _field(512, check="positive integer", arch=True, required=True)
    q_lora_rank: int = _field(2048, check="positive integer", arch=True, required=True)
    qk_rope_head_dim: int = _field(64, check="positive integer", arch=True, required=True)
    v_head_dim: int = _field(256, check="positive integer", arch=True, required=True)
    qk_nope_head_dim: int = _field(192, check="positive integer", arch=True, required=True)
    n_group: int = _field(1, check="positive integer")
    topk_group: int = _field(1, check="positive integer")
    num_experts_per_tok: int = _field(8, check="positive integer", required=True)
    norm_topk_prob: bool = _field(True, required=True)
    hidden_act: str = "silu"
    max_position_embeddings: int = _field(202752, check="positive integer", required=True)
    initializer_range: float = _field(0.02, check="non-negative number")
    rms_norm_eps: float = _field(1e-5, check="positive number", required=True)
    pad_token_id: Optional[int] = _field(None, mcore="pad_token_id",
                                         doc="Embedding padding index (None: no padding_idx).")
    bos_token_id: Optional[int] = 0
    eos_token_id: Union[int, List[int], None] = 1
    tie_word_embeddings: bool = False
    # config.json: rope_parameters.rope_theta (or a top-level rope_theta)
    rope_theta: float = _field(10000.0, check="positive number", hf="special", required=True)
    attention_bias: bool = False
    attention_dropout: float = _field(0.0, check="non-negative number")
    # a top-k of 0 selects nothing
    index_topk: int = _field(2048, check="positive integer", required=True, mcore="dsa_index_topk",
                             doc="Keys kept per query by the sparse attention.")
    index_head_dim: int = _field(128, check="positive integer", arch=True, required=True,
                                 mcore="dsa_index_head_dim",
                                 doc="Lightning-indexer head dim (RoPE on its first qk_pos_emb_head_dim dims).")
    index_n_heads: int = _field(32, check="positive integer", arch=True, required=True, mcore="dsa_index_n_heads",
                                doc="Lightning-indexer heads.")
    # an explicit mlp_layer_types list stands in for it
    first_k_dense_replace: int = _field(3, check="non-negative integer", required="mlp_layer_types")
    # config.json: an explicit list, else derived from first_k_dense_replace
    mlp_layer_types: Optional[List[str]] = _field(None, hf="special", arch=True)
    # config.json: an explicit list, else index_topk_pattern, else index_topk_freq / index_skip_topk_offset
    indexer_types: Optional[List[str]] = _field(
        None, hf="special", arch=True, mcore="dsa_indexer_types", mcore_type=tuple,
        doc='Per main layer "full" (own indexer) or "shared" (reuse the nearest earlier full layer\'s top-k); '
            "empty means all full.")
    num_nextn_predict_layers: int = _field(0, check="non-negative integer")
    index_share_for_mtp_iteration: bool = _field(
        False, mcore="dsa_mtp_indexer_shared", mcore_type=bool,
        doc="index_share_for_mtp_iteration: MTP iterations after the first reuse the first one's top-k.")
    moe_router_dtype: Optional[str] = _field(None, hf_omit_none=True)
    raw: Optional[Dict[str, Any]] = _field(None, hf=None, repr=False, compare=False)

    # ---------------------------------------------------------------- construction
    def __post_init__(self) -> None:
        if self.mlp_layer_types is None:
            self.mlp_layer_types = _dense_first_mlp_types(self.num_hidden_layers, self.first_k_dense_replace) \
                if _is_int(self.num_hidden_layers) and self.num_hidden_layers > 0 else []
        else:
            self.mlp_layer_types = list(self.mlp_layer_types)
        if self.indexer_types is None:
            n = self.num_hidden_layers if _is_int(self.num_hidden_layers) and self.num_hidden_layers > 0 else 0
            self.indexer_types = ["full"] * n
        else:
            self.indexer_types = list(self.indexer_types)
        if isinstance(self.eos_token_id, tuple):
            self.eos_token_id = list(self.eos_token_id)
        self.validate()

    def validate(self) -> None:
        """Raise :class:`ConfigError` (naming the field) when the configuration is inconsistent."""
        for check, ok in _RANGE_CHECKS.items():
            for name in _CHECKED[check]:
                v = getattr(self, name)
                if not ok(v):
                    raise ConfigError(f"{name} must be a {check}, got {v!r}", field=name)
        if self.qk_rope_head_dim % 2:
            raise ConfigError(
                f"qk_rope_head_dim must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}",
                field="qk_rope_head_dim",
            )
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ConfigError(
                f"index_head_dim ({self.index_head_dim}) must be >= qk_rope_head_dim ({self.qk_rope_head_dim}): "
                "RoPE covers the first qk_rope_head_dim dims of the indexer head",
                field="index_head_dim",
            )
        # MoE routing.
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= n_routed_experts "
                f"({self.n_routed_experts})",
                field="num_experts_per_tok",
            )
        if self.n_routed_experts % self.n_group:
            raise ConfigError(
                f"n_routed_experts ({self.n_routed_experts}) must be divisible by n_group ({self.n_group})",
                field="n_group",
            )
        if self.topk_group > self.n_group:
            raise ConfigError(
                f"topk_group ({self.topk_group}) must be <= n_group ({self.n_group})", field="topk_group"
            )
        per_group = self.n_routed_experts // self.n_group
        if per_group < 2:
            raise ConfigError(
                f"n_routed_experts / n_group must be >= 2 (a group is scored by its top-2 experts), "
                f"got {self.n_routed_experts} / {self.n_group}",
                field="n_group",
            )
        if self.num_experts_per_tok > self.topk_group * per_group:
            raise ConfigError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts of the topk_group "
                f"({self.topk_group}) selected groups ({self.topk_group * per_group})",
                field="num_experts_per_tok",
            )
        if self.moe_router_dtype not in (None, "float32", "fp32", "float64", "fp64"):
            raise ConfigError(
                f"moe_router_dtype must be float32 or float64, got {self.moe_router_dtype!r}",
                field="moe_router_dtype",
            )
        # Per-layer lists.
        n = self.num_hidden_layers
        if len(self.mlp_layer_types) != n:
            raise ConfigError(
                f"len(mlp_layer_types) is {len(self.mlp_layer_types)}, num_hidden_layers is {n}",
                field="mlp_layer_types",
            )
        bad = sorted({t for t in self.mlp_layer_types if t not in MLP_LAYER_TYPES}, key=str)
        if bad:
            raise ConfigError(
                f"mlp_layer_types: unknown type(s) {', '.join(map(repr, bad))} (expected 'dense' or 'sparse')",
                field="mlp_layer_types",
            )
        _check_indexer_types(self.indexer_types, n, "indexer_types", "num_hidden_layers")
        if self.pad_token_id is not None and not (_is_int(self.pad_token_id) and 0 <= self.pad_token_id < self.vocab_size):
            raise ConfigError(
                f"pad_token_id ({self.pad_token_id!r}) must be None or in [0, vocab_size={self.vocab_size})",
                field="pad_token_id",
            )
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act must be 'silu', got {self.hidden_act!r}", field="hidden_act")
        if self.first_k_dense_replace > n:
            raise ConfigError(
                f"first_k_dense_replace ({self.first_k_dense_replace}) exceeds num_hidden_layers ({n}): the model "
                "has no MoE layer left (set it to at most the layer count)",
                field="first_k_dense_replace",
            )
        if self.index_topk > self.max_position_embeddings:
            raise ConfigError(
                f"index_topk ({self.index_topk}) exceeds max_position_embeddings ({self.max_position_embeddings}): "
                "the sparse attention would keep more keys than a sequence can hold",
                field="index_topk",
            )

    @classmethod
    def from_hf(cls, src: Union[str, os.PathLike, Mapping[str, Any], Any]) -> "GLM5Config":
        """Read a GlmMoeDsa config: a directory holding config.json, a json file, a dict or a PretrainedConfig."""
        d, name = _load_hf_dict(src)
        fields = _fields_from_hf_dict(d, name)
        try:
            return cls(**fields, raw=copy.deepcopy(d))
        except ConfigError as e:
            raise ConfigError(f"{name}: {e}", field=e.field) from None

    @classmethod
    def from_preset(cls, name: str) -> "GLM5Config":
        """One of :data:`PRESETS` (see the module docstring's table)."""
        if name not in _PRESET_BUILDERS:
            raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}", field="preset")
        return cls.from_hf(_PRESET_BUILDERS[name]())

    def replace(self, **changes: Any) -> "GLM5Config":
        """``dataclasses.replace`` that re-derives ``mlp_layer_types`` / ``indexer_types`` when the layer count
        (or ``first_k_dense_replace``) changes and the list is not given explicitly."""
        n_new = changes.get("num_hidden_layers", self.num_hidden_layers)
        if ("num_hidden_layers" in changes or "first_k_dense_replace" in changes) and "mlp_layer_types" not in changes:
            changes["mlp_layer_types"] = None
        if "num_hidden_layers" in changes and "indexer_types" not in changes:
            changes["indexer_types"] = self._indexer_schedule(n_new)
        return dataclasses.replace(self, **changes)

    def _indexer_schedule(self, n: int) -> List[str]:
        raw = self.raw or {}
        if "index_topk_freq" in raw or "index_skip_topk_offset" in raw:
            sched = _freq_offset_indexer_types(n, raw.get("index_topk_freq"), raw.get("index_skip_topk_offset"))
            if sched[: self.num_hidden_layers] == self.indexer_types[:n]:
                return sched
        if all(t == "full" for t in self.indexer_types):
            return ["full"] * n
        if n <= len(self.indexer_types):
            return list(self.indexer_types[:n])
        raise ConfigError(
            f"cannot extend indexer_types from {self.num_hidden_layers} to {n} layers; pass indexer_types",
            field="indexer_types",
        )

    # ---------------------------------------------------------------- derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_moe_layers(self) -> int:
        return sum(1 for t in self.mlp_layer_types if t == "sparse")

    @property
    def num_dense_layers(self) -> int:
        return self.num_hidden_layers - self.num_moe_layers

    @property
    def full_layers(self) -> List[int]:
        return [i for i, t in enumerate(self.indexer_types) if t == "full"]

    @property
    def shared_layers(self) -> List[int]:
        return [i for i, t in enumerate(self.indexer_types) if t == "shared"]

    def _check_layer(self, i: int) -> None:
        if not _is_int(i) or not 0 <= i < self.num_hidden_layers:
            raise IndexError(f"layer {i!r} out of range [0, {self.num_hidden_layers})")

    def index_source_layer(self, i: int) -> int:
        """0-based index of the layer whose top-k layer ``i`` uses: the nearest full layer <= i."""
        self._check_layer(i)
        return _index_source_layer(self.indexer_types, i)

    def is_moe_layer(self, i: int) -> bool:
        self._check_layer(i)
        return self.mlp_layer_types[i] == "sparse"

    def is_full_indexer_layer(self, i: int) -> bool:
        self._check_layer(i)
        return self.indexer_types[i] == "full"

    # ---------------------------------------------------------------- HF export
    def _hf_value(self, key: str) -> Any:
        return copy.deepcopy(getattr(self, key))

    def _full_hf_dict(self) -> Dict[str, Any]:
        d: Dict[str, Any] = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE}
        for key in _SIMPLE_KEYS:
            v = self._hf_value(key)
            if key in _HF_OMIT_NONE and v is None:
                continue
            d[key] = v
        d["rope_parameters"] = {"rope_theta": self.rope_theta, "rope_type": "default"}
        d["indexer_types"] = list(self.indexer_types)
        if self.mlp_layer_types != _dense_first_mlp_types(self.num_hidden_layers, self.first_k_dense_replace):
            d["mlp_layer_types"] = list(self.mlp_layer_types)
        d["qk_head_dim"] = self.qk_head_dim
        d.update(dtype="bfloat16", use_cache=True, scoring_func="sigmoid", topk_method="noaux_tc")
        return dict(sorted(d.items()))

    def to_hf(self) -> Dict[str, Any]:
        """The config.json dict.  Exact inverse of :meth:`from_hf` for an unchanged config; fields that were
        changed after loading are written back (in the source's own encoding where possible)."""
        if self.raw is None:
            return self._full_hf_dict()
        out = copy.deepcopy(self.raw)
        try:
            base = GLM5Config(**_fields_from_hf_dict(self.raw, "<raw>"))
        except (ConfigError, TypeError):
            base = None
        n = self.num_hidden_layers

        for key in _SIMPLE_KEYS:
            v = getattr(self, key)
            if base is not None and getattr(base, key) == v:
                continue  # unchanged: keep the source's spelling (or absence) of the key
            if key in _HF_OMIT_NONE and v is None:
                out.pop(key, None)
                continue
            out[key] = copy.deepcopy(v)
            for alias in _HF_ALIASES.get(key, ()):
                out.pop(alias, None)

        if base is None or base.rope_theta != self.rope_theta:
            rp = out.get("rope_parameters")
            wrote = False
            if isinstance(rp, dict):
                rp["rope_theta"] = self.rope_theta
                wrote = True
            if "rope_theta" in out:
                out["rope_theta"] = self.rope_theta
                wrote = True
            if not wrote:
                out["rope_parameters"] = {"rope_theta": self.rope_theta, "rope_type": "default"}

        # mlp_layer_types: authoritative; write explicitly only when the stored encoding does not reproduce it.
        if out.get("mlp_layer_types") is not None:
            if list(out["mlp_layer_types"]) != self.mlp_layer_types:
                out["mlp_layer_types"] = list(self.mlp_layer_types)
        elif _dense_first_mlp_types(n, out.get("first_k_dense_replace", 3)) != self.mlp_layer_types:
            out["mlp_layer_types"] = list(self.mlp_layer_types)

        # indexer_types: keep the source's encoding (explicit list / pattern / freq+offset) when it still holds.
        target = list(self.indexer_types)
        if _safe_resolve(out, n) != target:
            if out.get("indexer_types") is None and out.get("index_topk_pattern") is not None:
                p = out["index_topk_pattern"]
                out["index_topk_pattern"] = (
                    "".join("F" if t == "full" else "S" for t in target) if isinstance(p, str) else target
                )
            else:
                out["indexer_types"] = target
            # Lower-precedence encodings that now disagree would mislead other readers: drop them.
            if out.get("indexer_types") is not None:
                p = out.get("index_topk_pattern")
                if p is not None and _safe(lambda: _pattern_indexer_types(p)) != target:
                    out["index_topk_pattern"] = None
            if out.get("indexer_types") is not None or out.get("index_topk_pattern") is not None:
                if ("index_topk_freq" in out or "index_skip_topk_offset" in out) and _safe(
                    lambda: _freq_offset_indexer_types(n, out.get("index_topk_freq"), out.get("index_skip_topk_offset"))
                ) != target:
                    out.pop("index_topk_freq", None)
                    out.pop("index_skip_topk_offset", None)

        # Keys transformers writes that are derived from the fields.
        if isinstance(out.get("layer_types"), list) and len(out["layer_types"]) != n:
            out["layer_types"] = ["indexed_attention"] * n
        if "qk_head_dim" in out and out["qk_head_dim"] != self.qk_head_dim:
            out["qk_head_dim"] = self.qk_head_dim
        if base is not None and "head_dim" in out and out["head_dim"] == base.qk_rope_head_dim:
            out["head_dim"] = self.qk_rope_head_dim  # transformers-saved style (head_dim := qk_rope_head_dim)
        return out

    def save_hf(self, path: Union[str, os.PathLike]) -> str:
        """Write :meth:`to_hf` as ``config.json`` (``path`` a directory or a .json file); returns the file."""
        path = os.fspath(path)
        if os.path.isdir(path) or not path.endswith(".json"):
            os.makedirs(path, exist_ok=True)
            path = os.path.join(path, "config.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_hf(), f, indent=2, sort_keys=True)
            f.write("\n")
        return path

    # ---------------------------------------------------------------- parameter counts
    def attention_parameters(self, full_indexer: bool = True) -> int:
        """Parameters of one layer's MLA attention (plus its DSA indexer when ``full_indexer``)."""
        h, nh = self.hidden_size, self.num_attention_heads
        qlr, kvlr, rope = self.q_lora_rank, self.kv_lora_rank, self.qk_rope_head_dim
        n = (
            h * qlr + qlr  # q_a_proj, q_a_layernorm
            + qlr * nh * self.qk_head_dim  # q_b_proj
            + h * (kvlr + rope) + kvlr  # kv_a_proj_with_mqa, kv_a_layernorm
            + kvlr * nh * (self.qk_nope_head_dim + self.v_head_dim)  # kv_b_proj
            + nh * self.v_head_dim * h  # o_proj
        )
        if self.attention_bias:
            n += qlr + (kvlr + rope) + h
        if full_indexer:
            n += self.indexer_parameters()
        return n

    def indexer_parameters(self) -> int:
        """wq_b + wk + k_norm (LayerNorm weight and bias) + weights_proj."""
        h, ih, idim = self.hidden_size, self.index_n_heads, self.index_head_dim
        return self.q_lora_rank * ih * idim + h * idim + 2 * idim + h * ih

    def mlp_parameters(self, moe: bool, include_buffers: bool = False) -> int:
        h = self.hidden_size
        if not moe:
            return 3 * h * self.intermediate_size
        e, mi = self.n_routed_experts, self.moe_intermediate_size
        n = e * 3 * h * mi + e * h + 3 * h * mi * self.n_shared_experts  # experts, router weight, shared expert
        if include_buffers:
            n += e  # e_score_correction_bias (a buffer)
        return n

    def layer_parameters(self, i: int, include_buffers: bool = False) -> int:
        self._check_layer(i)
        return (
            self.attention_parameters(self.indexer_types[i] == "full")
            + self.mlp_parameters(self.mlp_layer_types[i] == "sparse", include_buffers)
            + 2 * self.hidden_size  # input_layernorm, post_attention_layernorm
        )

    def mtp_parameters(self, include_buffers: bool = False) -> int:
        """Extra parameters of the MTP block(s), without the (tied) embedding and output head."""
        h = self.hidden_size
        per_layer = (
            self.attention_parameters(True)
            + self.mlp_parameters(True, include_buffers)
            + 2 * h  # the decoder layer's two norms
            + 2 * h * h  # eh_proj
            + 3 * h  # enorm, hnorm, shared_head.norm
        )
        return self.num_nextn_predict_layers * per_layer

    def count_parameters(self, include_mtp: bool = False, include_buffers: bool = False) -> int:
        """Exact parameter count, equal to ``sum(p.numel() for p in GlmMoeDsaForCausalLM(cfg).parameters())``
        (the MoE ``e_score_correction_bias`` is a buffer; ``include_buffers`` adds it).  ``include_mtp`` adds
        :meth:`mtp_parameters`."""
        h, v = self.hidden_size, self.vocab_size
        n = v * h + h  # embed_tokens, final norm
        if not self.tie_word_embeddings:
            n += v * h  # lm_head
        n += sum(self.layer_parameters(i, include_buffers) for i in range(self.num_hidden_layers))
        if include_mtp:
            n += self.mtp_parameters(include_buffers)
        return n

    # ---------------------------------------------------------------- parallel layout
    def validate_layout(
        self,
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
        etp: Optional[int] = None,
        cp: int = 1,
        seq_length: Optional[int] = None,
    ) -> None:
        """Raise :class:`ConfigError` naming the flag and the model field it fails to divide."""
        etp_eff = tp if etp is None else etp
        for flag, v in (("--tp", tp), ("--pp", pp), ("--ep", ep), ("--etp", etp_eff), ("--cp", cp)):
            if not _is_int(v) or v < 1:
                raise ConfigError(f"{flag} must be a positive integer, got {v!r}", field=flag)
        checks = [
            ("--tp", tp, "num_attention_heads", self.num_attention_heads),
            ("--tp", tp, "intermediate_size", self.intermediate_size),
            ("--tp", tp, "moe_intermediate_size * n_shared_experts",
             self.moe_intermediate_size * self.n_shared_experts),
            ("--ep", ep, "n_routed_experts", self.n_routed_experts),
            ("--etp", etp_eff, "moe_intermediate_size", self.moe_intermediate_size),
            ("--pp", pp, "num_hidden_layers", self.num_hidden_layers),
        ]
        for flag, v, name, value in checks:
            if value % v:
                raise ConfigError(f"{flag} {v} does not divide {name} {value}", field=name)
        if seq_length is not None:
            if not _is_int(seq_length) or seq_length < 1:
                raise ConfigError(f"--seq-length must be a positive integer, got {seq_length!r}", field="seq_length")
            check_cp_seq_length(seq_length, cp)

    # ---------------------------------------------------------------- megatron
    def to_transformer_config(self, **overrides: Any):
        """The megatron-core :class:`GLM5TransformerConfig` for this model; ``overrides`` (parallel sizes,
        dtypes, any field) are applied last.  ``pipeline_dtype`` follows ``params_dtype`` unless overridden."""
        import torch

        cls = transformer_config_class()
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(k for k in overrides if k not in known)
        if unknown:
            raise ConfigError(
                f"unknown GLM5TransformerConfig override(s): {', '.join(unknown)}", field=unknown[0]
            )
        ep = overrides.get("expert_model_parallel_size", 1) or 1
        if self.n_routed_experts % ep:
            raise ConfigError(f"--ep {ep} does not divide n_routed_experts {self.n_routed_experts}",
                              field="n_routed_experts")
        if self.attention_bias:
            raise ConfigError("attention_bias=True has no megatron mapping here (GLM-5 has no attention bias)",
                              field="attention_bias")
        grouped = self.n_group > 1
        kw: Dict[str, Any] = dict(
            num_layers=self.num_hidden_layers,
            hidden_size=self.hidden_size,
            ffn_hidden_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            multi_latent_attention=True,
            q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank,
            qk_head_dim=self.qk_nope_head_dim,
            qk_pos_emb_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            qk_layernorm=True,
            rope_type="rope",
            rotary_base=float(self.rope_theta),
            rotary_scaling_factor=1.0,
            normalization="RMSNorm",
            layernorm_epsilon=self.rms_norm_eps,
            gated_linear_unit=True,
            activation_func=torch.nn.functional.silu,
            add_bias_linear=False,
            add_qkv_bias=False,
            hidden_dropout=0.0,
            attention_dropout=float(self.attention_dropout),
            init_method_std=self.initializer_range,
            num_moe_experts=self.n_routed_experts,
            moe_router_topk=self.num_experts_per_tok,
            moe_ffn_hidden_size=self.moe_intermediate_size,
            moe_shared_expert_intermediate_size=(self.moe_intermediate_size * self.n_shared_experts) or None,
            moe_layer_freq=[1 if t == "sparse" else 0 for t in self.mlp_layer_types],
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_bias_update_rate=1e-3,
            moe_router_topk_scaling_factor=float(self.routed_scaling_factor),
            moe_router_num_groups=self.n_group if grouped else None,
            moe_router_group_topk=self.topk_group if grouped else None,
            moe_router_dtype="fp32",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=False,
            moe_norm_topk_prob=bool(self.norm_topk_prob),
            mtp_num_layers=self.num_nextn_predict_layers or None,
            mtp_loss_scaling_factor=0.1,
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
            masked_softmax_fusion=False,
            gradient_accumulation_fusion=False,
            persist_layer_norm=False,
            transformer_impl="local",  # GLM-5's specs use megatron-core's local modules (+ our own), never TE's
            use_cpu_initialization=not torch.cuda.is_available(),
            params_dtype=torch.float32,
            bf16=False,
        )
        for name, (mcore, convert) in _MCORE_FIELDS.items():  # the GLM-5 fields megatron-core lacks
            kw[mcore] = getattr(self, name) if convert is None else convert(getattr(self, name))
        if self.moe_router_dtype in ("float64", "fp64"):
            kw["moe_router_dtype"] = "fp64"
        kw.update(overrides)
        if "pipeline_dtype" not in overrides:
            kw["pipeline_dtype"] = kw["params_dtype"]
        try:
            return cls(**kw)
        except ConfigError:
            raise
        except (ValueError, AssertionError, NotImplementedError) as e:
            raise ConfigError(f"megatron TransformerConfig rejected the GLM-5 config: {e}") from e


# Tables derived from the field declarations (see _field).
_FIELDS: Tuple[dataclasses.Field, ...] = tuple(f for f in dataclasses.fields(GLM5Config))
_DEFAULTS: Dict[str, Any] = {f.name: f.default for f in _FIELDS}
# Fields stored under their own name in config.json, and the defaults used for those keys when missing.
_SIMPLE_KEYS: Tuple[str, ...] = tuple(f.name for f in _FIELDS if _meta(f, "hf") == "same")
_HF_DEFAULTS: Dict[str, Any] = {k: _DEFAULTS[k] for k in _SIMPLE_KEYS}
_HF_ALIASES: Dict[str, Tuple[str, ...]] = {f.name: _meta(f, "hf_aliases") for f in _FIELDS if _meta(f, "hf_aliases")}
_HF_OMIT_NONE = frozenset(f.name for f in _FIELDS if _meta(f, "hf_omit_none"))
_CHECKED: Dict[str, Tuple[str, ...]] = {
    check: tuple(f.name for f in _FIELDS if _meta(f, "check") == check) for check in _RANGE_CHECKS
}
# The fields a config.json must state (GLM5Config.from_hf; docs/design.md "Config fields" says why each).
REQUIRED_HF_FIELDS: Tuple[str, ...] = tuple(f.name for f in _FIELDS if _meta(f, "required"))
# The fields that shape the weights: a checkpoint must agree with the model on them (training/checkpointing.py).
ARCH_FIELDS: Tuple[str, ...] = tuple(f.name for f in _FIELDS if _meta(f, "arch"))
# GLM5Config field -> (GLM5TransformerConfig field, converter or None)
_MCORE_FIELDS: Dict[str, Tuple[str, Optional[type]]] = {
    f.name: (_meta(f, "mcore"), _meta(f, "mcore_type")) for f in _FIELDS if _meta(f, "mcore")
}


def _safe(fn):
    try:
        return fn()
    except ConfigError:
        return None


def _safe_resolve(d: Mapping[str, Any], n: int) -> Optional[List[str]]:
    return _safe(lambda: _resolve_indexer_types(d, n))


# --------------------------------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------------------------------

# The released GLM-5 sizes are transformers' GlmMoeDsaConfig defaults (_HF_DEFAULTS); the released configs differ
# in the token ids and carry one MTP layer. max_position_embeddings and the IndexShare keys are set per version.
_GLM5_BASE = dict(
    {k: v for k, v in _HF_DEFAULTS.items()
     if k not in ("max_position_embeddings", "bos_token_id", "index_share_for_mtp_iteration", "moe_router_dtype")},
    pad_token_id=154820,
    eos_token_id=[154820, 154827, 154829],
    num_nextn_predict_layers=1,
)


def _glm5_v1() -> Dict[str, Any]:  # GLM-5 and GLM-5.1
    cfg = GLM5Config(**_GLM5_BASE, rope_theta=1000000, max_position_embeddings=202752)
    d = cfg.to_hf()
    d.pop("bos_token_id", None)  # the GLM-5 config.json has no bos_token_id
    return d


def _glm5_v2() -> Dict[str, Any]:  # GLM-5.2 and GLM-5.3: IndexShare
    cfg = GLM5Config(
        **_GLM5_BASE,
        rope_theta=8000000,
        max_position_embeddings=1048576,
        indexer_types=_freq_offset_indexer_types(78, 4, 3),
        index_share_for_mtp_iteration=True,
        moe_router_dtype="float32",
    )
    d = cfg.to_hf()
    d.pop("bos_token_id", None)
    d.update(
        head_dim=192,  # present in the real config.json; NOT a width (transformers ignores it)
        index_topk_freq=4,
        index_skip_topk_offset=3,
        index_topk_pattern=None,
        indexer_rope_interleave=True,
        rope_interleave=True,
        ep_size=1,
        moe_layer_freq=1,
        pretraining_tp=1,
    )
    return dict(sorted(d.items()))


_TINY_BASE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    routed_scaling_factor=2.5,
    kv_lora_rank=16,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    v_head_dim=16,
    qk_nope_head_dim=16,
    n_group=1,
    topk_group=1,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    max_position_embeddings=4096,
    initializer_range=0.02,
    rms_norm_eps=1e-5,
    pad_token_id=0,  # the shipped tiny tokenizer: <|endoftext|> = 0 is eod and pad
    bos_token_id=None,
    eos_token_id=0,
    tie_word_embeddings=False,
    rope_theta=10000.0,
    index_topk=16,
    index_head_dim=16,
    # 8 indexer heads: with 4, a key scores exactly 0 (all heads' ReLU off) 1 time in 16, and such ties
    # at the top-k boundary make the selection ambiguous in parity tests.
    index_n_heads=8,
    first_k_dense_replace=1,
    num_nextn_predict_layers=1,
)


def _tiny() -> Dict[str, Any]:
    return GLM5Config(**_TINY_BASE).to_hf()


def _tiny_indexshare() -> Dict[str, Any]:
    return GLM5Config(
        **_TINY_BASE,
        indexer_types=["full", "shared", "full", "shared"],
        index_share_for_mtp_iteration=True,
        moe_router_dtype="float32",
    ).to_hf()


def _tiny_groups() -> Dict[str, Any]:
    return GLM5Config(**{**_TINY_BASE, "n_group": 2, "topk_group": 1}).to_hf()


_PRESET_BUILDERS = {
    "glm5": _glm5_v1,
    "glm5.1": _glm5_v1,
    "glm5.2": _glm5_v2,
    "glm5.3": _glm5_v2,
    "tiny": _tiny,
    "tiny-indexshare": _tiny_indexshare,
    "tiny-groups": _tiny_groups,
}
PRESETS: Tuple[str, ...] = tuple(_PRESET_BUILDERS)


# --------------------------------------------------------------------------------------------------------------
# megatron-core side (lazy)
# --------------------------------------------------------------------------------------------------------------

def _apply_pre_import_shims() -> None:
    from megatron_glm5 import platform as _platform  # noqa: PLC0415

    _platform.apply_pre_import_shims()


_TRANSFORMER_CONFIG_CLASS = None


def _glm5_model_fields(base: type) -> type:
    """A dataclass subclass of ``base`` with one field per GLM5Config field declared with ``mcore=`` (its name, its
    converted default, its ``doc`` as metadata): GLM5TransformerConfig's copy of the model fields, derived."""
    specs = []
    for f in _FIELDS:
        mcore, convert = _meta(f, "mcore"), _meta(f, "mcore_type")
        if mcore:
            default = f.default if convert is None else convert() if f.default is None else convert(f.default)
            specs.append((mcore, f.type if convert is None else convert,
                          field(default=default, metadata={"doc": _meta(f, "doc"), "glm5_field": f.name})))
    cls = dataclasses.make_dataclass("GLM5ModelFields", specs, bases=(base,))
    cls.__module__ = __name__
    return cls


def transformer_config_class():
    """The :class:`GLM5TransformerConfig` class (a dataclass subclass of megatron's MLATransformerConfig),
    created on first use so that importing this module does not import megatron.core."""
    global _TRANSFORMER_CONFIG_CLASS
    if _TRANSFORMER_CONFIG_CLASS is not None:
        return _TRANSFORMER_CONFIG_CLASS
    _apply_pre_import_shims()
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    @dataclass
    class GLM5TransformerConfig(_glm5_model_fields(MLATransformerConfig)):
        """megatron-core MLA config plus the GLM-5 fields: the model's (vocabulary, DSA indexer, IndexShare: declared
        on GLM5Config with ``mcore=``) and the training ones below."""

        dsa_stage: str = "sparse"
        """"sparse" (top-k attention) or "dense-warmup" (dense attention, only the indexer trained)."""
        dsa_indexer_loss_coeff: float = 0.0
        """Weight of the indexer KL loss (0 disables it)."""
        dsa_freeze_indexer: bool = False
        """Freeze the indexer weights."""
        dsa_backend: str = "torch"
        """Kernel backend for the indexer / sparse attention."""
        dsa_chunk_size: int = 1024
        """Query chunk for the memory-bounded torch backend."""
        latent_norm_eps: float = 1e-6
        """eps of q_a / kv_a RMSNorms and of the indexer k_norm LayerNorm (transformers hard-codes 1e-6)."""
        moe_norm_topk_prob: bool = True
        """Normalise the selected sigmoid scores to sum 1 before routed_scaling_factor."""
        moe_hybridep_node_size: Optional[int] = None
        """--node-size: GPUs per node for --dispatcher hybridep's torch.distributed implementation
        (model/hybridep_dispatcher.py; None: $LOCAL_WORLD_SIZE, else min(world size, 8))."""
        moe_triton_permute_fusion: Optional[bool] = None
        """--moe-permute-fusion: our Triton permute/unpermute kernels (ops/triton_moe_permute.py) in the alltoall
        and allgather dispatchers; None: on when CUDA and triton are available. (megatron-core's own
        moe_permute_fusion means Transformer Engine's kernels and stays off.)"""
        cross_entropy_fusion: str = "none"
        """--cross-entropy-fusion: "chunked" computes the LM head's loss without materialising the logits
        (model/linear_cross_entropy.py); "native" / "none" leave it to megatron-core."""
        elementwise_fusion: bool = False
        """--fusions: run the elementwise regions (model/fusions.py) torch.compile'd on CUDA tensors."""
        fp32_router_and_indexer_weights: bool = True
        """Keep the router weight and the indexer's weights_proj in fp32 whatever params_dtype is (transformers'
        choice; right for inference). Training turns it off: megatron-core's bf16 optimizers need one parameter
        dtype (they keep fp32 master copies of every parameter anyway, and the router computes in fp32)."""

        def __post_init__(self):
            super().__post_init__()
            self.dsa_indexer_types = tuple(self.dsa_indexer_types) or ("full",) * self.num_layers
            _check_indexer_types(self.dsa_indexer_types, self.num_layers, "dsa_indexer_types", "num_layers")
            if self.dsa_stage not in DSA_STAGES:
                raise ConfigError(
                    f"dsa_stage must be one of {DSA_STAGES}, got {self.dsa_stage!r}", field="dsa_stage"
                )
            if self.dsa_index_head_dim < self.qk_pos_emb_head_dim:
                raise ConfigError(
                    f"dsa_index_head_dim ({self.dsa_index_head_dim}) must be >= qk_pos_emb_head_dim "
                    f"({self.qk_pos_emb_head_dim})",
                    field="dsa_index_head_dim",
                )
            for name in ("dsa_index_n_heads", "dsa_index_topk", "dsa_chunk_size", "vocab_size"):
                if getattr(self, name) <= 0:
                    raise ConfigError(f"{name} must be positive, got {getattr(self, name)}", field=name)
            if self.dsa_indexer_loss_coeff < 0:
                raise ConfigError("dsa_indexer_loss_coeff must be >= 0", field="dsa_indexer_loss_coeff")

        @property
        def dsa_full_layers(self) -> Tuple[int, ...]:
            return tuple(i for i, t in enumerate(self.dsa_indexer_types) if t == "full")

        def dsa_index_source_layer(self, i: int) -> int:
            """0-based main layer whose top-k layer i uses (the nearest full layer <= i)."""
            return _index_source_layer(self.dsa_indexer_types, i)

    GLM5TransformerConfig.__module__ = __name__
    GLM5TransformerConfig.__qualname__ = "GLM5TransformerConfig"
    _TRANSFORMER_CONFIG_CLASS = GLM5TransformerConfig
    return GLM5TransformerConfig


def __getattr__(name: str):  # PEP 562: `from megatron_glm5.config import GLM5TransformerConfig` (and pickling)
    if name == "GLM5TransformerConfig":
        return transformer_config_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
