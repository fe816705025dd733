"""Tests for megatron_glm5.config: presets, HF round trip, validation, parameter counts, megatron mapping.

Expected numbers come from /work/shared/GLM5_REFERENCE.md (not from the code under test).
"""

import copy
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from megatron_glm5.config import PRESETS, ConfigError, GLM5Config

from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# A copy of the public GLM-5.3 config.json (tests/data/), so the round-trip test always runs.
REFERENCE_JSON = REPO / "tests" / "data" / "glm5.3_config.json"


@pytest.fixture(scope="module")
def ref53():
    return json.loads(REFERENCE_JSON.read_text())


def hf_view(cfg: GLM5Config) -> GlmMoeDsaConfig:
    return GlmMoeDsaConfig(**cfg.to_hf())


def assert_agrees_with_transformers(cfg: GLM5Config, hc: GlmMoeDsaConfig = None):
    """Every field transformers models resolves to the same value as ours."""
    hc = hc or hf_view(cfg)
    for f in dataclasses.fields(cfg):
        if f.name in ("raw", "rope_theta", "num_nextn_predict_layers", "index_share_for_mtp_iteration",
                      "moe_router_dtype"):
            continue
        assert getattr(hc, f.name) == getattr(cfg, f.name), f.name
    assert hc.rope_parameters["rope_theta"] == cfg.rope_theta


# ------------------------------------------------------------------------------------------------ presets

GLM5_FULL_LAYERS_V2 = [0, 1, 2] + list(range(6, 78, 4))  # IndexShare freq 4 offset 3: 0,1,2,6,10,...,74


@pytest.mark.parametrize("name", ["glm5", "glm5.1", "glm5.2", "glm5.3"])
def test_real_presets_match_reference(name):
    c = GLM5Config.from_preset(name)
    assert (c.hidden_size, c.num_hidden_layers, c.first_k_dense_replace, c.intermediate_size) == (6144, 78, 3, 12288)
    assert c.mlp_layer_types == ["dense"] * 3 + ["sparse"] * 75
    assert c.num_moe_layers == 75
    assert (c.num_attention_heads, c.num_key_value_heads, c.q_lora_rank, c.kv_lora_rank) == (64, 64, 2048, 512)
    assert (c.qk_nope_head_dim, c.qk_rope_head_dim, c.qk_head_dim, c.v_head_dim) == (192, 64, 256, 256)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_shared_experts, c.moe_intermediate_size) == (256, 8, 1, 2048)
    assert (c.n_group, c.topk_group, c.norm_topk_prob, c.routed_scaling_factor) == (1, 1, True, 2.5)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk) == (32, 128, 2048)
    assert (c.vocab_size, c.rms_norm_eps, c.tie_word_embeddings, c.attention_bias) == (154880, 1e-5, False, False)
    assert c.num_nextn_predict_layers == 1
    assert c.eos_token_id == [154820, 154827, 154829] and c.pad_token_id == 154820
    hf = c.to_hf()
    assert hf["architectures"] == ["GlmMoeDsaForCausalLM"] and hf["model_type"] == "glm_moe_dsa"
    assert len(hf["indexer_types"]) == 78  # explicit list in every preset
    if name in ("glm5", "glm5.1"):
        assert c.rope_theta == 1e6 and c.max_position_embeddings == 202752
        assert c.indexer_types == ["full"] * 78 and c.shared_layers == []
        assert not c.index_share_for_mtp_iteration and c.moe_router_dtype is None
    else:
        assert c.rope_theta == 8e6 and c.max_position_embeddings == 1048576
        assert c.full_layers == GLM5_FULL_LAYERS_V2
        assert len(c.full_layers) == 21 and len(c.shared_layers) == 57
        assert c.index_share_for_mtp_iteration and c.moe_router_dtype == "float32"
        assert hf["head_dim"] == 192 and hf["index_topk_freq"] == 4 and hf["index_skip_topk_offset"] == 3
    assert_agrees_with_transformers(c)


def test_glm5_pairs_identical():
    assert GLM5Config.from_preset("glm5") == GLM5Config.from_preset("glm5.1")
    assert GLM5Config.from_preset("glm5.2") == GLM5Config.from_preset("glm5.3")
    assert GLM5Config.from_preset("glm5") != GLM5Config.from_preset("glm5.3")


def test_glm53_preset_equals_real_config(ref53):
    c = GLM5Config.from_preset("glm5.3")
    assert c == GLM5Config.from_hf(ref53)
    hf = c.to_hf()
    # The preset's config.json is the real one plus the explicit indexer_types list (and no transformers_version).
    assert {k: v for k, v in hf.items() if k != "indexer_types"} == {
        k: v for k, v in ref53.items() if k != "transformers_version"
    }


@pytest.mark.parametrize("name", ["tiny", "tiny-indexshare", "tiny-groups"])
def test_tiny_presets(name):
    c = GLM5Config.from_preset(name)
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.first_k_dense_replace) == (512, 64, 4, 1)
    assert (c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank) == (4, 32, 16)
    assert (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (16, 8, 16)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.intermediate_size) == (8, 2, 32, 128)
    assert (c.n_shared_experts, c.index_n_heads, c.index_head_dim, c.index_topk) == (1, 8, 16, 16)
    assert c.index_head_dim > c.qk_rope_head_dim
    assert (c.num_nextn_predict_layers, c.pad_token_id, c.rope_theta) == (1, 0, 10000)
    assert c.mlp_layer_types == ["dense", "sparse", "sparse", "sparse"]
    if name == "tiny-indexshare":
        assert c.indexer_types == ["full", "shared", "full", "shared"]
        assert [c.index_source_layer(i) for i in range(4)] == [0, 0, 2, 2]
    else:
        assert c.indexer_types == ["full"] * 4
    if name == "tiny-groups":
        assert (c.n_group, c.topk_group) == (2, 1)
    else:
        assert (c.n_group, c.topk_group) == (1, 1)
    assert_agrees_with_transformers(c)


def test_unknown_preset():
    with pytest.raises(ConfigError, match=r"unknown preset 'glm4'; choose one of: glm5, glm5\.1, .*tiny"):
        GLM5Config.from_preset("glm4")


def test_derived_helpers():
    c = GLM5Config.from_preset("glm5.3")
    assert c.index_source_layer(0) == 0 and c.index_source_layer(2) == 2
    assert c.index_source_layer(3) == 2 and c.index_source_layer(5) == 2 and c.index_source_layer(6) == 6
    assert c.index_source_layer(77) == 74
    assert not c.is_moe_layer(2) and c.is_moe_layer(3) and c.is_moe_layer(77)
    with pytest.raises(IndexError):
        c.is_moe_layer(78)
    with pytest.raises(IndexError):
        c.index_source_layer(-1)


# ------------------------------------------------------------------------------------------------ HF round trip


def test_roundtrip_real_glm53(ref53, tmp_path):
    assert GLM5Config.from_hf(ref53).to_hf() == ref53
    f = tmp_path / "my.json"
    f.write_text(json.dumps(ref53))
    assert GLM5Config.from_hf(f).to_hf() == ref53
    assert GLM5Config.from_hf(str(f)).to_hf() == ref53
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(ref53))
    c = GLM5Config.from_hf(d)
    assert c.to_hf() == ref53
    # head_dim 192 is ignored for every width; rope_theta comes from rope_parameters.
    assert c.qk_head_dim == 256 and c.v_head_dim == 256 and c.rope_theta == 8e6
    assert c.full_layers == GLM5_FULL_LAYERS_V2
    assert c.indexer_types == GlmMoeDsaConfig(**ref53).indexer_types


def test_roundtrip_transformers_saved(tmp_path):
    hc = GlmMoeDsaConfig(**GLM5Config.from_preset("tiny-indexshare").to_hf())
    hc.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    c = GLM5Config.from_hf(tmp_path)
    assert c.to_hf() == saved
    assert c == GLM5Config.from_preset("tiny-indexshare")
    # to_dict() (architectures None, dtype None, id2label, ...) round-trips too; so does a config object.
    d = hc.to_dict()
    assert GLM5Config.from_hf(d).to_hf() == d
    assert GLM5Config.from_hf(hc).to_hf() == d
    # A default transformers config (freq/offset defaults, mlp_layer_types written explicitly).
    d0 = GlmMoeDsaConfig(num_hidden_layers=6, first_k_dense_replace=2).to_dict()
    c0 = GLM5Config.from_hf(d0)
    assert c0.to_hf() == d0 and c0.indexer_types == ["full"] * 6 and c0.num_moe_layers == 4


ENCODINGS = {
    "explicit": {"indexer_types": ["full", "shared", "shared", "full", "shared", "full"]},
    "pattern_str": {"index_topk_pattern": "FSSFSF"},
    "pattern_list": {"index_topk_pattern": ["full", "shared", "shared", "full", "shared", "full"]},
    "freq_offset": {"index_topk_freq": 2, "index_skip_topk_offset": 3},
    "freq_only": {"index_topk_freq": 3},
    "offset_only": {"index_skip_topk_offset": 4},
    "defaults": {},
    "explicit_wins": {"indexer_types": ["full"] * 6, "index_topk_pattern": "FSSSSS", "index_topk_freq": 4},
    "pattern_wins": {"index_topk_pattern": "FFSFFS", "index_topk_freq": 4, "index_skip_topk_offset": 3},
    "glm53_style": {"index_topk_freq": 4, "index_skip_topk_offset": 3, "index_topk_pattern": None},
}


# keys of _small_hf a config.json may leave out (everything else in it is required)
OPTIONAL_IN_SMALL_HF = ("architectures", "model_type")


def _small_hf(**extra):
    d = {
        "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
        "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
        "num_hidden_layers": 6, "num_attention_heads": 2, "num_key_value_heads": 2, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "q_lora_rank": 16, "kv_lora_rank": 8, "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4, "v_head_dim": 8, "index_n_heads": 2, "index_head_dim": 8, "index_topk": 4,
        "first_k_dense_replace": 1, "rope_parameters": {"rope_theta": 5000.0, "rope_type": "default"},
        "n_shared_experts": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
    }
    d.update(extra)
    return d


@pytest.mark.parametrize("enc", list(ENCODINGS))
def test_indexshare_encodings_roundtrip_and_agree(enc):
    d = _small_hf(**ENCODINGS[enc])
    c = GLM5Config.from_hf(d)
    assert c.to_hf() == d
    hc = GlmMoeDsaConfig(**copy.deepcopy(d))
    assert c.indexer_types == hc.indexer_types
    assert c.mlp_layer_types == hc.mlp_layer_types
    assert_agrees_with_transformers(c, hc)


def test_expected_encoding_values():
    assert GLM5Config.from_hf(_small_hf(index_topk_pattern="FSSFSF")).full_layers == [0, 3, 5]
    assert GLM5Config.from_hf(_small_hf(index_topk_freq=2, index_skip_topk_offset=3)).full_layers == [0, 1, 2, 4]
    assert GLM5Config.from_hf(_small_hf()).shared_layers == []


def test_legacy_rope_theta_and_missing_keys():
    d = _small_hf(rope_theta=12345.0)
    del d["rope_parameters"]
    c = GLM5Config.from_hf(d)
    assert c.rope_theta == 12345.0 and c.to_hf() == d
    # Optional keys missing from the json take transformers' defaults.
    lean = {k: v for k, v in _small_hf().items() if k not in OPTIONAL_IN_SMALL_HF}
    c_lean = GLM5Config.from_hf(lean)
    assert_agrees_with_transformers(c_lean, GlmMoeDsaConfig(**copy.deepcopy(lean)))
    assert c_lean.to_hf() == lean
    assert (c_lean.n_group, c_lean.bos_token_id, c_lean.pad_token_id, c_lean.indexer_types) == (1, 0, None, ["full"] * 6)


def test_head_dim_key_is_ignored():
    a = GLM5Config.from_hf(_small_hf(head_dim=192))
    b = GLM5Config.from_hf(_small_hf())
    assert a == b and a.qk_head_dim == 12


def test_direct_construction_emits_complete_config():
    c = GLM5Config(**{f.name: getattr(GLM5Config.from_preset("tiny"), f.name)
                      for f in dataclasses.fields(GLM5Config) if f.name != "raw"})
    assert c.raw is None
    hf = c.to_hf()
    for key in ("architectures", "model_type", "rope_parameters", "indexer_types", "num_nextn_predict_layers",
                "dtype", "hidden_size", "index_topk", "first_k_dense_replace"):
        assert key in hf, key
    assert hf["architectures"] == ["GlmMoeDsaForCausalLM"] and hf["model_type"] == "glm_moe_dsa"
    assert hf["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}
    assert hf["dtype"] == "bfloat16"
    assert GLM5Config.from_hf(hf) == c and GLM5Config.from_hf(hf).to_hf() == hf
    assert_agrees_with_transformers(c)
    # Defaults are transformers' defaults; a non-derivable mlp pattern is written explicitly.
    assert_agrees_with_transformers(GLM5Config(), GlmMoeDsaConfig())
    odd = GLM5Config.from_preset("tiny").replace(mlp_layer_types=["dense", "sparse", "dense", "sparse"])
    assert odd.to_hf()["mlp_layer_types"] == ["dense", "sparse", "dense", "sparse"]
    assert_agrees_with_transformers(odd)


def test_changed_fields_win(ref53):
    c = GLM5Config.from_hf(ref53)
    c2 = dataclasses.replace(c, rope_theta=1e6, vocab_size=155136, index_topk=1024)
    out = c2.to_hf()
    assert out["rope_parameters"] == {"rope_theta": 1e6, "rope_type": "default"}
    assert out["vocab_size"] == 155136 and out["index_topk"] == 1024
    assert GLM5Config.from_hf(out) == c2
    unchanged = {k for k in ref53 if k not in ("rope_parameters", "vocab_size", "index_topk")}
    assert all(out[k] == ref53[k] for k in unchanged)

    # Fewer layers, same IndexShare schedule: the freq/offset encoding is kept.
    c3 = c.replace(num_hidden_layers=10)
    assert c3.full_layers == [0, 1, 2, 6] and len(c3.mlp_layer_types) == 10
    out3 = c3.to_hf()
    assert "indexer_types" not in out3 and out3["index_topk_freq"] == 4
    assert GLM5Config.from_hf(out3) == c3
    assert_agrees_with_transformers(c3)

    # A pattern that freq/offset cannot express: written explicitly, the stale freq/offset keys dropped.
    c4 = dataclasses.replace(c3, indexer_types=["full", "shared"] * 5)
    out4 = c4.to_hf()
    assert out4["indexer_types"] == ["full", "shared"] * 5
    assert "index_topk_freq" not in out4 and "index_skip_topk_offset" not in out4
    assert GLM5Config.from_hf(out4) == c4
    assert_agrees_with_transformers(c4)

    # The pattern encoding stays a pattern.
    c5 = GLM5Config.from_hf(_small_hf(index_topk_pattern="FSSFSF"))
    out5 = dataclasses.replace(c5, indexer_types=["full"] * 6).to_hf()
    assert out5["index_topk_pattern"] == "FFFFFF" and "indexer_types" not in out5

    # first_k_dense_replace changes the derived mlp pattern (no explicit list in the source).
    c6 = c.replace(first_k_dense_replace=1)
    assert c6.num_moe_layers == 77 and c6.to_hf()["first_k_dense_replace"] == 1
    assert "mlp_layer_types" not in c6.to_hf()
    assert_agrees_with_transformers(c6)

    # A transformers-saved dict keeps layer_types / qk_head_dim / head_dim consistent.
    hd = GlmMoeDsaConfig(**_small_hf()).to_dict()
    c7 = GLM5Config.from_hf(hd).replace(num_hidden_layers=3, qk_rope_head_dim=2)
    out7 = c7.to_hf()
    assert len(out7["layer_types"]) == 3 and out7["qk_head_dim"] == 10 and out7["head_dim"] == 2
    assert_agrees_with_transformers(c7)


# ------------------------------------------------------------------------------------------------ validation

VALIDATION_CASES = [
    ({"indexer_types": ["shared", "full", "full", "full", "full", "full"]}, "indexer_types"),
    ({"index_topk_pattern": "SFFFFF"}, "indexer_types"),
    ({"index_topk": 0}, "index_topk"),
    ({"index_topk": -5}, "index_topk"),
    ({"n_routed_experts": 6, "n_group": 4}, "n_group"),
    ({"n_group": 2, "topk_group": 3}, "topk_group"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"indexer_types": ["full"] * 5}, "indexer_types"),
    ({"index_head_dim": 2}, "index_head_dim"),
    ({"indexer_types": ["full", "sparse", "full", "full", "full", "full"]}, "indexer_types"),
    ({"index_topk_pattern": "FXFFFF"}, "index_topk_pattern"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"num_attention_heads": -1}, "num_attention_heads"),
    ({"q_lora_rank": None}, "q_lora_rank"),
    ({"moe_intermediate_size": 0}, "moe_intermediate_size"),
    ({"vocab_size": 0}, "vocab_size"),
    ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ({"mlp_layer_types": ["dense"] * 5}, "mlp_layer_types"),
    ({"mlp_layer_types": ["dense", "moe", "sparse", "sparse", "sparse", "sparse"]}, "mlp_layer_types"),
    ({"rms_norm_eps": 0}, "rms_norm_eps"),
    ({"qk_rope_head_dim": 3}, "qk_rope_head_dim"),
    ({"pad_token_id": 128}, "pad_token_id"),
]


@pytest.mark.parametrize("change,field", VALIDATION_CASES)
def test_validation_errors_name_field_and_file(change, field, tmp_path):
    d = _small_hf(**change)
    with pytest.raises(ConfigError) as ei:
        GLM5Config.from_hf(d)
    assert field in str(ei.value)
    assert issubclass(ConfigError, ValueError)
    p = tmp_path / "config.json"
    p.write_text(json.dumps(d))
    with pytest.raises(ConfigError) as ei:
        GLM5Config.from_hf(tmp_path)
    msg = str(ei.value)
    assert field in msg and str(p) in msg and "\n" not in msg


def test_direct_construction_validates():
    with pytest.raises(ConfigError, match="index_topk"):
        GLM5Config(index_topk=0)
    with pytest.raises(ConfigError, match="indexer_types"):
        dataclasses.replace(GLM5Config.from_preset("tiny"), indexer_types=["full"] * 3)


@pytest.mark.parametrize(
    "change,field",
    [({"model_type": "deepseek_v3"}, "model_type"), ({"architectures": ["DeepseekV3ForCausalLM"]}, "architectures")],
)
def test_rejects_other_models(change, field, tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(_small_hf(**change)))
    with pytest.raises(ConfigError) as ei:
        GLM5Config.from_hf(p)
    msg = str(ei.value)
    assert field in msg and str(p) in msg and "\n" not in msg


# ------------------------------------------------------------------------------------------------ parameter counts


def _hf_params(cfg: GLM5Config, meta: bool) -> int:
    hc = hf_view(cfg)
    if meta:
        with torch.device("meta"):
            model = GlmMoeDsaForCausalLM(hc)
    else:
        model = GlmMoeDsaForCausalLM(hc)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", ["tiny", "tiny-indexshare", "tiny-groups"])
def test_param_count_tiny_exact(name):
    c = GLM5Config.from_preset(name)
    assert c.count_parameters() == _hf_params(c, meta=False)


@pytest.mark.parametrize("name", ["glm5", "glm5.3"])
def test_param_count_real_exact(name):
    c = GLM5Config.from_preset(name)
    assert c.count_parameters() == _hf_params(c, meta=True)


def test_param_count_bias_is_buffer_and_tied():
    c = GLM5Config.from_preset("tiny")
    hc = hf_view(c)
    model = GlmMoeDsaForCausalLM(hc)
    buffers = {n for n, _ in model.named_buffers()}
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in buffers
    assert c.count_parameters(include_buffers=True) - c.count_parameters() == c.num_moe_layers * 8
    tied = c.replace(tie_word_embeddings=True)
    assert c.count_parameters() - tied.count_parameters() == 512 * 64
    assert tied.count_parameters() == _hf_params(tied, meta=True)
    biased = c.replace(attention_bias=True)
    assert biased.count_parameters() == _hf_params(biased, meta=True)


@pytest.mark.parametrize("name", ["tiny-indexshare", "glm5.3"])
def test_mtp_extra(name):
    """MTP extra = one full MoE decoder layer with indexer (measured as transformers' layer L) + eh_proj + 3 norms."""
    c = GLM5Config.from_preset(name)
    h, n = c.hidden_size, c.num_hidden_layers
    longer = c.replace(num_hidden_layers=n + 1, indexer_types=c.indexer_types + ["full"],
                       mlp_layer_types=c.mlp_layer_types + ["sparse"])
    layer = _hf_params(longer, meta=True) - _hf_params(c, meta=True)
    extra = c.count_parameters(include_mtp=True) - c.count_parameters()
    assert extra == layer + 2 * h * h + 3 * h
    if name == "glm5.3":
        assert extra == 9_952_920_320


def test_glm5_total_about_743_4b():
    # GLM5_REFERENCE.md: "About 743.4B parameters without MTP".  Exactly: GLM-5.2/5.3 (21 indexers)
    # 743.377e9; GLM-5/5.1 (78 indexers) 743.911e9 -- both within 0.1% of the documented figure.
    g5 = GLM5Config.from_preset("glm5").count_parameters()
    g53 = GLM5Config.from_preset("glm5.3").count_parameters()
    assert round(g53 / 1e9, 1) == 743.4
    assert abs(g5 / 743.4e9 - 1) < 1e-3
    assert g5 - g53 == 57 * GLM5Config.from_preset("glm5").indexer_parameters()


# ------------------------------------------------------------------------------------------------ megatron


def test_import_does_not_import_megatron_core():
    """megatron.core is imported only inside functions (static check: a subprocess would cost seconds)."""
    import ast

    import megatron_glm5.config as mc

    tree = ast.parse(Path(mc.__file__).read_text())
    for node in tree.body:  # module-level statements only
        for sub in ast.walk(node) if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) else ():
            if isinstance(sub, ast.Import):
                assert not any(a.name.startswith("megatron.") for a in sub.names), ast.dump(sub)
            if isinstance(sub, ast.ImportFrom):
                assert not (sub.module or "").startswith("megatron."), ast.dump(sub)
    assert "GLM5TransformerConfig" not in mc.__all__  # star-import stays lazy


@pytest.mark.parametrize("name", PRESETS)
def test_transformer_config_all_presets(name):
    c = GLM5Config.from_preset(name)
    t = c.to_transformer_config()
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    assert isinstance(t, MLATransformerConfig)
    assert type(t).__name__ == "GLM5TransformerConfig"
    assert (t.num_layers, t.hidden_size, t.ffn_hidden_size, t.num_attention_heads) == (
        c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.num_attention_heads)
    assert (t.q_lora_rank, t.kv_lora_rank, t.qk_head_dim, t.qk_pos_emb_head_dim, t.v_head_dim) == (
        c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim)
    assert t.multi_latent_attention and t.qk_layernorm and t.rope_type == "rope"
    assert t.rotary_base == c.rope_theta and t.rotary_scaling_factor == 1.0
    assert t.normalization == "RMSNorm" and t.layernorm_epsilon == c.rms_norm_eps
    assert t.gated_linear_unit and t.activation_func is torch.nn.functional.silu and not t.add_bias_linear
    assert (t.num_moe_experts, t.moe_router_topk, t.moe_ffn_hidden_size) == (
        c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size)
    assert t.moe_shared_expert_intermediate_size == c.moe_intermediate_size * c.n_shared_experts
    assert t.moe_layer_freq == [0 if m == "dense" else 1 for m in c.mlp_layer_types]
    assert t.moe_router_score_function == "sigmoid" and t.moe_router_enable_expert_bias
    assert t.moe_router_topk_scaling_factor == c.routed_scaling_factor and t.moe_router_dtype == "fp32"
    assert t.moe_router_load_balancing_type == "none" and t.moe_aux_loss_coeff == 0.0
    assert t.moe_token_dispatcher_type == "alltoall" and t.moe_norm_topk_prob is True
    if c.n_group > 1:
        assert (t.moe_router_num_groups, t.moe_router_group_topk) == (c.n_group, c.topk_group)
    else:
        assert t.moe_router_num_groups is None and t.moe_router_group_topk is None
    assert t.mtp_num_layers == 1 and t.mtp_loss_scaling_factor == 0.1
    assert t.params_dtype == torch.float32 and t.pipeline_dtype == torch.float32 and not t.bf16
    assert t.vocab_size == c.vocab_size and t.pad_token_id == c.pad_token_id
    assert (t.dsa_index_n_heads, t.dsa_index_head_dim, t.dsa_index_topk) == (
        c.index_n_heads, c.index_head_dim, c.index_topk)
    assert t.dsa_indexer_types == tuple(c.indexer_types)
    assert t.dsa_mtp_indexer_shared == c.index_share_for_mtp_iteration
    assert (t.dsa_stage, t.dsa_indexer_loss_coeff, t.dsa_freeze_indexer) == ("sparse", 0.0, False)
    assert (t.dsa_backend, t.dsa_chunk_size, t.latent_norm_eps) == ("torch", 1024, 1e-6)
    assert t.init_method is not None  # megatron's __post_init__ ran


def test_transformer_config_parallel_and_overrides():
    c = GLM5Config.from_preset("tiny")
    t = c.to_transformer_config(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                sequence_parallel=True, params_dtype=torch.bfloat16, bf16=True,
                                dsa_stage="dense-warmup", dsa_indexer_loss_coeff=1e-3, moe_aux_loss_coeff=1e-4)
    assert (t.tensor_model_parallel_size, t.expert_model_parallel_size, t.sequence_parallel) == (2, 2, True)
    assert t.params_dtype == torch.bfloat16 and t.pipeline_dtype == torch.bfloat16 and t.bf16
    assert t.dsa_stage == "dense-warmup" and t.dsa_indexer_loss_coeff == 1e-3 and t.moe_aux_loss_coeff == 1e-4
    t2 = c.to_transformer_config(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                 expert_tensor_parallel_size=1, context_parallel_size=2)
    assert t2.expert_tensor_parallel_size == 1 and t2.context_parallel_size == 2
    with pytest.raises(ConfigError, match="no_such_field"):
        c.to_transformer_config(no_such_field=1)
    with pytest.raises(ConfigError, match=r"^--ep 3 does not divide n_routed_experts 8$"):
        c.to_transformer_config(expert_model_parallel_size=3)
    with pytest.raises(ConfigError, match="dsa_stage"):
        c.to_transformer_config(dsa_stage="bogus")
    # megatron's own validation surfaces as ConfigError.
    with pytest.raises(ConfigError, match="tensor_model_parallel_size"):
        c.to_transformer_config(tensor_model_parallel_size=3)


def test_transformer_config_is_picklable_by_name():
    import pickle

    import megatron_glm5.config as mc

    t = GLM5Config.from_preset("tiny-indexshare").to_transformer_config()
    assert mc.GLM5TransformerConfig is type(t)
    t2 = pickle.loads(pickle.dumps(t))
    assert t2.dsa_indexer_types == ("full", "shared", "full", "shared")
    assert t2.dsa_index_source_layer(3) == 2


# ------------------------------------------------------------------------------------------------ layout


def test_validate_layout():
    c = GLM5Config.from_preset("glm5.3")
    c.validate_layout(tp=8, pp=6, ep=64, etp=1, cp=4, seq_length=8192)
    cases = [
        (dict(tp=3), "--tp 3", "num_attention_heads"),
        (dict(ep=3), "--ep 3", "n_routed_experts"),
        (dict(pp=5), "--pp 5", "num_hidden_layers"),
        (dict(etp=3), "--etp 3", "moe_intermediate_size"),
        (dict(cp=3, seq_length=8192), "--cp", "seq"),
        (dict(tp=0), "--tp", ""),
    ]
    for kw, flag, field in cases:
        with pytest.raises(ConfigError) as ei:
            c.validate_layout(**kw)
        assert flag in str(ei.value) and field in str(ei.value), (kw, str(ei.value))
    # index_n_heads is not sharded: tp 64 is fine even though the indexer has 32 heads.
    c.validate_layout(tp=64, etp=1)
    # the one --seq-length vs --cp check, worded as the flag error validate_args reports
    with pytest.raises(ConfigError, match=r"^--seq-length 8192 is not divisible by 2 x --cp 3 = 6 \(load-balanced"):
        c.validate_layout(cp=3, seq_length=8192)


# ------------------------------------------------------------------------------------------------ one field table


def test_field_declarations_are_the_one_table():
    """config.json defaults, range checks and GLM5TransformerConfig's model fields follow from GLM5Config's fields."""
    import megatron_glm5.config as mc

    fields = {f.name: f for f in dataclasses.fields(GLM5Config)}
    # a missing optional config.json key means the field's default
    required_only = {name: fields[name].default for name in mc.REQUIRED_HF_FIELDS if name != "rope_theta"}
    required_only["rope_parameters"] = {"rope_theta": fields["rope_theta"].default}
    assert GLM5Config.from_hf(required_only) == GLM5Config()
    assert set(mc._HF_DEFAULTS) == set(fields) - {"rope_theta", "mlp_layer_types", "indexer_types", "raw"}
    assert all(mc._HF_DEFAULTS[k] == fields[k].default for k in mc._HF_DEFAULTS)
    for name in ("hidden_size", "index_topk"):
        with pytest.raises(ConfigError, match=f"^{name} must be a positive integer, got 0$"):
            GLM5Config(**{name: 0})
    with pytest.raises(ConfigError, match=r"^first_k_dense_replace must be a non-negative integer, got -1$"):
        GLM5Config(first_k_dense_replace=-1)

    tfields = {f.name: f for f in dataclasses.fields(mc.transformer_config_class())}
    c = GLM5Config.from_preset("tiny-indexshare")
    t = c.to_transformer_config()
    assert set(mc._MCORE_FIELDS) == {"vocab_size", "pad_token_id", "index_topk", "index_head_dim", "index_n_heads",
                                     "indexer_types", "index_share_for_mtp_iteration"}
    for name, (mcore, convert) in mc._MCORE_FIELDS.items():
        assert getattr(t, mcore) == (getattr(c, name) if convert is None else convert(getattr(c, name))), name
        assert tfields[mcore].metadata["glm5_field"] == name
    assert (tfields["dsa_index_topk"].default, tfields["dsa_index_n_heads"].default) == (2048, 32)
    assert tfields["dsa_indexer_types"].default == () and tfields["dsa_mtp_indexer_shared"].default is False
    # one indexer-types check, on both sides
    with pytest.raises(ConfigError, match=r"^dsa_indexer_types: layer 0 is 'shared'"):
        c.to_transformer_config(dsa_indexer_types=("shared", "full", "full", "full"))
    with pytest.raises(ConfigError, match=r"^indexer_types: layer 0 is 'shared'"):
        dataclasses.replace(c, indexer_types=["shared", "full", "full", "full"])


def test_dsa_stages_defined_once():
    import megatron_glm5.config as mc
    from megatron_glm5.model import dsa

    assert mc.DSA_STAGES == ("dense-warmup", "sparse") and dsa.DSA_STAGES is mc.DSA_STAGES


# ------------------------------------------------------------------------------------------------ required fields

# The decision (docs/design.md "Config fields"): every size, and every hyper-parameter whose transformers default
# is GLM-5's own value, must be stated by a config.json; written here, not read from the code under test.
REQUIRED = ["vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts",
            "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
            "qk_nope_head_dim", "num_experts_per_tok", "norm_topk_prob", "max_position_embeddings", "rms_norm_eps",
            "rope_theta", "index_topk", "index_head_dim", "index_n_heads", "first_k_dense_replace"]


def test_required_fields_are_the_documented_ones(ref53):
    import megatron_glm5.config as mc

    assert list(mc.REQUIRED_HF_FIELDS) == REQUIRED
    # every one is in the real GLM-5.3 config.json (its rope_theta under rope_parameters)
    assert all(k in ref53 for k in REQUIRED if k != "rope_theta") and "rope_theta" in ref53["rope_parameters"]
    design = (REPO / "docs" / "design.md").read_text()
    assert all(f"`{k}`" in design for k in REQUIRED)


@pytest.mark.parametrize("name", REQUIRED)
def test_missing_required_field_is_refused(name, tmp_path):
    d = _small_hf()
    d.pop("rope_parameters" if name == "rope_theta" else name)
    p = tmp_path / "config.json"
    p.write_text(json.dumps(d))
    with pytest.raises(ConfigError) as ei:
        GLM5Config.from_hf(p)
    msg = str(ei.value)
    assert msg.startswith(f"{p}: missing required field {name} (not assumed to be GLM-5's ") and "\n" not in msg
    assert ei.value.field == name


def test_missing_fields_named_together_and_stand_ins():
    d = _small_hf()
    for k in ("hidden_size", "n_routed_experts", "index_topk"):
        d.pop(k)
    with pytest.raises(ConfigError, match=r"missing required fields hidden_size, n_routed_experts, index_topk "
                                          r"\(not assumed to be GLM-5's 6144, 256, 2048\); add them"):
        GLM5Config.from_hf(d)
    # an alias, a top-level rope_theta and an explicit mlp_layer_types list state their fields
    d = _small_hf(num_local_experts=4, rope_theta=7.0, mlp_layer_types=["dense"] + ["sparse"] * 5)
    for k in ("n_routed_experts", "rope_parameters", "first_k_dense_replace"):
        d.pop(k)
    c = GLM5Config.from_hf(d)
    assert (c.n_routed_experts, c.rope_theta, c.num_dense_layers) == (4, 7.0, 1)


@pytest.mark.parametrize("change,message", [
    ({"index_topk": 300}, "index_topk (300) exceeds max_position_embeddings (256)"),
    ({"first_k_dense_replace": 7}, "first_k_dense_replace (7) exceeds num_hidden_layers (6)"),
])
def test_inconsistent_sizes_are_refused(change, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        GLM5Config.from_hf(_small_hf(**change))
    GLM5Config.from_hf(_small_hf(index_topk=256, first_k_dense_replace=6))  # equal is fine
