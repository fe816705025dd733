"""Real GLM-5 sizes on the meta device: parameter counts equal transformers', and the one HF<->Megatron table
covers every tensor of both sides exactly once."""
from collections import Counter

import pytest
import torch
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

import megatron_glm5
from megatron_glm5 import GLM5Config, build_model
from megatron_glm5.conversion.hf_mapping import conversion_plan, hf_fused_to_disk_names

REAL = ["glm5", "glm5.1", "glm5.2", "glm5.3"]


@pytest.fixture(scope="module")
def parallel():
    megatron_glm5.initialize_model_parallel()


def _meta_models(name):
    cfg = GLM5Config.from_preset(name)
    with torch.device("meta"):
        ours = build_model(cfg, perform_initialization=False)
        theirs = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**cfg.to_hf()))
    return cfg, ours, theirs


@pytest.mark.parametrize("name", REAL)
def test_parameter_count_equals_transformers(parallel, name):
    cfg, ours, theirs = _meta_models(name)
    main = sum(p.numel() for n, p in ours.named_parameters() if not n.startswith("mtp."))
    assert main == sum(p.numel() for p in theirs.parameters())
    # MTP (HF layer 78): one MoE decoder layer with its own indexer, plus eh_proj [H, 2H] and three norms
    # (enorm, hnorm, shared_head.norm); its embedding and head are the main model's in megatron-core.
    full_moe = next(i for i in range(cfg.num_hidden_layers)
                    if cfg.indexer_types[i] == "full" and cfg.mlp_layer_types[i] == "sparse")
    h = cfg.hidden_size
    expected_mtp = sum(p.numel() for p in theirs.model.layers[full_moe].parameters()) + 2 * h * h + 3 * h
    assert sum(p.numel() for n, p in ours.named_parameters() if n.startswith("mtp.")) == expected_mtp
    if name in ("glm5.2", "glm5.3"):
        assert round(main / 1e9, 1) == 743.4  # GLM5_REFERENCE.md: about 743.4B without MTP


@pytest.mark.parametrize("name", REAL)
def test_mapping_covers_every_tensor_once(parallel, name):
    cfg, ours, theirs = _meta_models(name)
    plan = conversion_plan(cfg, include_mtp=True)
    hf_counts = Counter(k for row in plan for k in row.hf)
    assert max(hf_counts.values()) == 1
    hf_disk = set(hf_fused_to_disk_names(theirs.state_dict()))
    mtp_prefix = f"model.layers.{cfg.num_hidden_layers}."
    assert {k for k in hf_counts if not k.startswith(mtp_prefix)} == hf_disk
    mc_counts = Counter(row.mcore for row in plan if row.mcore is not None)
    assert max(mc_counts.values()) == 1
    ours_keys = {k for k, v in ours.state_dict().items() if torch.is_tensor(v)}
    assert set(mc_counts) == ours_keys


def test_building_logs_no_gpt_model_deprecation(parallel, caplog):
    """GLM5Model is a GPTModel on purpose: megatron-core's "GPTModel IS DEPRECATED" warning is not shown (patch
    gpt_model_deprecation_log; with MEGATRON_GLM5_DISABLE_SHIMS=gpt_model_deprecation_log this test fails)."""
    import logging

    with caplog.at_level(logging.WARNING, logger="megatron.core.models.gpt.gpt_model"):
        with torch.device("meta"):
            build_model(GLM5Config.from_preset("tiny"), perform_initialization=False)
    assert [r.getMessage() for r in caplog.records if "GPTModel IS DEPRECATED" in r.getMessage()] == []


def test_building_a_model_drops_the_previous_jobs_aux_loss_scale(parallel):
    """megatron-core's MoEAuxLossAutoScaler keeps its backward scale process-wide; a backward outside the schedule
    leaves a 0-dim 1.0 there, into which the schedule's [1]-shaped scale cannot be copied. build_model drops it, so
    a job built after another in the same process (the tests, a notebook) sets its own."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.main_loss_backward_scale = torch.tensor(1.0)  # as a bare backward leaves it
    with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):
        MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))
    with torch.device("meta"):
        build_model(GLM5Config.from_preset("tiny"), perform_initialization=False)
    assert MoEAuxLossAutoScaler.main_loss_backward_scale is None
    MoEAuxLossAutoScaler.set_loss_scale(torch.full((1,), 0.5))  # what the schedule does each micro-batch
    MoEAuxLossAutoScaler.set_loss_scale(torch.full((1,), 0.25))
    assert MoEAuxLossAutoScaler.main_loss_backward_scale.tolist() == [0.25]
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
