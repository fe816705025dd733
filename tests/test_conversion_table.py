"""In-memory HF <-> Megatron conversion through the one table, MTP included, and loader errors."""
import json
import os

import pytest
import torch
from safetensors.torch import save_file

import megatron_glm5
from megatron_glm5 import GLM5Config, build_model
from megatron_glm5.config import ConfigError
from megatron_glm5.conversion.hf_mapping import hf_to_mcore, mcore_to_hf
from megatron_glm5.conversion.safetensors_io import CheckpointError
from hf_tiny import make_hf_model, save_hf_model


def _tensor_state(model):
    return {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}


@pytest.mark.parametrize("preset", ["tiny", "tiny-indexshare", "tiny-groups"])
def test_roundtrip_is_bitwise_with_mtp(preset):
    megatron_glm5.initialize_model_parallel(seed=3)
    cfg = GLM5Config.from_preset(preset)
    model = build_model(cfg)  # tiny presets have one MTP layer
    state = _tensor_state(model)
    assert any(k.startswith("mtp.layers.0.mtp_model_layer.self_attention.core_attention.indexer.") for k in state)
    hf = mcore_to_hf(state, cfg)
    mtp = f"model.layers.{cfg.num_hidden_layers}."
    assert f"{mtp}eh_proj.weight" in hf and f"{mtp}shared_head.head.weight" in hf
    assert f"{mtp}mlp.experts.0.gate_proj.weight" in hf
    back = hf_to_mcore(hf, cfg)
    assert back.keys() == state.keys()
    for k in state:
        assert back[k].dtype == state[k].dtype and torch.equal(back[k], state[k]), k
    assert state["decoder.layers.1.mlp.router.weight"].dtype == torch.float32


def test_hf_state_dict_of_transformers_converts_both_ways():
    hf, cfg = make_hf_model("tiny-indexshare")
    theirs = hf.state_dict()
    mc = hf_to_mcore(theirs, cfg, include_mtp=False)
    disk = mcore_to_hf(mc, cfg, include_mtp=False)
    # transformers fuses experts in memory (gate_up_proj); the table speaks the on-disk per-expert names
    gate_up = theirs["model.layers.1.mlp.experts.gate_up_proj"]
    inter = cfg.moe_intermediate_size
    assert torch.equal(disk["model.layers.1.mlp.experts.3.gate_proj.weight"], gate_up[3, :inter])
    assert torch.equal(disk["model.layers.1.mlp.experts.3.up_proj.weight"], gate_up[3, inter:])
    assert torch.equal(disk["model.layers.0.mlp.up_proj.weight"], theirs["model.layers.0.mlp.up_proj.weight"])
    assert "model.layers.1.self_attn.indexer.wk.weight" not in disk  # shared layer: no indexer


def test_from_hf_pretrained_loads_mtp_weights(tmp_path):
    megatron_glm5.initialize_model_parallel(seed=5)
    cfg = GLM5Config.from_preset("tiny")
    source = build_model(cfg)
    hf_state = {k: v.detach().cpu().clone() for k, v in mcore_to_hf(_tensor_state(source), cfg).items()}
    save_file(hf_state, str(tmp_path / "model.safetensors"))
    cfg.save_hf(tmp_path)
    loaded = megatron_glm5.from_hf_pretrained(str(tmp_path))
    assert loaded.mtp is not None
    for k, v in _tensor_state(source).items():
        assert torch.equal(_tensor_state(loaded)[k].cpu(), v.cpu()), k
    no_mtp = megatron_glm5.from_hf_pretrained(str(tmp_path), mtp=False)
    assert not any(k.startswith("mtp.") for k in _tensor_state(no_mtp))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    hf, _ = make_hf_model("tiny")
    return save_hf_model(hf, tmp_path_factory.mktemp("hf"))


def _copy_dir(src, dst):
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
            g.write(f.read())
    return dst


def test_missing_safetensors(tmp_path, hf_dir):
    d = _copy_dir(hf_dir, tmp_path / "d")
    os.remove(d / "model.safetensors")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        megatron_glm5.from_hf_pretrained(str(d))


def test_index_naming_a_missing_shard(tmp_path, hf_dir):
    d = _copy_dir(hf_dir, tmp_path / "d")
    os.rename(d / "model.safetensors", d / "model-00001-of-00002.safetensors")
    from safetensors import safe_open
    with safe_open(str(d / "model-00001-of-00002.safetensors"), "pt") as f:
        keys = list(f.keys())
    weight_map = {k: "model-00001-of-00002.safetensors" for k in keys}
    weight_map[keys[0]] = "model-00002-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors, which is missing"):
        megatron_glm5.from_hf_pretrained(str(d))


def test_truncated_safetensors(tmp_path, hf_dir):
    d = _copy_dir(hf_dir, tmp_path / "d")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        megatron_glm5.from_hf_pretrained(str(d))


def test_wrong_architecture(tmp_path, hf_dir):
    d = _copy_dir(hf_dir, tmp_path / "d")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "llama", ["LlamaForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="config.json"):
        megatron_glm5.from_hf_pretrained(str(d))


def test_weights_disagreeing_with_config(tmp_path, hf_dir):
    d = _copy_dir(hf_dir, tmp_path / "d")
    cfg = json.loads((d / "config.json").read_text())
    cfg["q_lora_rank"] = 48
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="q_a_proj.weight gives shape"):
        megatron_glm5.from_hf_pretrained(str(d))
