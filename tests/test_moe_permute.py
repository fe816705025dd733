"""The fused MoE permute/unpermute (megatron_glm5/ops/triton_moe_permute.py, --moe-permute-fusion) against
megatron-core's unfused ``moe_utils.permute`` / ``unpermute``.

CPU: the kernels run under Triton's interpreter in one subprocess (tests/moe_permute_interp_runner.py); this process
builds the cases, runs the same pipeline (permute -> per-slot function -> unpermute -> loss, backward) with
megatron's functions and compares. fp32: forward and both gradients bitwise equal (same summation order). bf16:
the gathers are exact, the sums (fp32 accumulation here, bf16 in megatron) within 1e-2 relative. End to end: a
2-layer tiny GLM-5 (one MoE layer) with the fused alltoall / allgather dispatcher gives bitwise the unfused
model's logits and every parameter gradient.
GPU (@pytest.mark.gpu): GLM-5 sizes (4096 tokens, hidden 6144, 256 experts, top-8) against the unfused path.
"""

import importlib.util

import pytest
import torch

from moe_permute_interp_runner import pipeline
from interp_harness import run_interpreted

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")
DISPATCHERS = ("alltoall", "allgather")
BF16_RTOL = 1e-2


def _topk_map(tokens, experts, topk, gen):
    """Each token's experts drawn in random order (the map forgets the order; the sums must not depend on it)."""
    idx = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)])
    return torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, idx, True)


def _case(routing_map, hidden, gen, dtype=torch.float32, num_out=None):
    tokens, experts = routing_map.shape
    probs = torch.rand(tokens, experts, generator=gen) * routing_map
    return dict(routing_map=routing_map, probs=probs, tokens=torch.randn(tokens, hidden, generator=gen).to(dtype),
                grad_out=torch.randn(tokens, hidden, generator=gen),
                num_out=int(routing_map.sum()) if num_out is None else num_out)


def build_cases():
    from megatron.core.transformer.moe.moe_utils import apply_router_token_dropping

    g = torch.Generator().manual_seed(0)
    uneven = torch.rand(12, 8, generator=g) < 0.3
    uneven[:, 0] = uneven[:, 7] = False  # empty experts, first and last
    uneven[3] = uneven[9] = False  # tokens routed nowhere
    uneven[5] = True  # a token routed everywhere
    top3 = _topk_map(16, 8, 3, g)
    scores = torch.rand(16, 8, generator=g) * top3
    dropped_probs, dropped_map = apply_router_token_dropping(scores, top3, router_topk=3, capacity_factor=0.5)
    assert dropped_map.sum() < top3.sum()
    capacity = _case(dropped_map, 24, g)
    capacity["probs"] = dropped_probs
    return {
        "topk": _case(_topk_map(13, 8, 3, g), 20, g),
        "two_hidden_blocks": _case(_topk_map(5, 4, 2, g), 2500, g),  # 2048 + a partial block
        "uneven": _case(uneven, 16, g),
        "capacity": capacity,
        "truncated": _case(_topk_map(10, 6, 2, g), 8, g, num_out=15),  # megatron keeps the first 15 rows
        "256_experts_top8": _case(_topk_map(6, 256, 8, g), 16, g),
        "bf16": _case(_topk_map(32, 8, 3, g), 64, g, dtype=torch.bfloat16),
    }


@pytest.fixture(scope="module")
def interp(tmp_path_factory):
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    cases = build_cases()
    return cases, run_interpreted(tmp_path_factory, "moe_permute", "moe_permute_interp_runner.py",
                                  dict(kernels=cases, dispatchers=DISPATCHERS), timeout=600)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


@needs_triton
@pytest.mark.parametrize("name", ["topk", "two_hidden_blocks", "uneven", "capacity", "truncated",
                                  "256_experts_top8"])
def test_interp_fp32_bitwise_equal_to_megatron(interp, name):
    from megatron.core.transformer.moe import moe_utils

    cases, results = interp
    ref = pipeline(cases[name], moe_utils.permute, moe_utils.unpermute)
    got = results[name]
    assert got["rows"].shape == ref["rows"].shape == (cases[name]["num_out"], cases[name]["tokens"].shape[1])
    for key in ("rows", "pprobs", "sorted_indices", "out", "grad_tokens", "grad_probs"):
        assert got[key].dtype == ref[key].dtype, key
        assert torch.equal(got[key], ref[key]), (key, (got[key].float() - ref[key].float()).abs().max().item())
    assert ref["grad_probs"].abs().sum() > 0 and ref["out"].abs().sum() > 0


@needs_triton
def test_interp_bf16_within_tolerance(interp):
    from megatron.core.transformer.moe import moe_utils

    cases, results = interp
    ref = pipeline(cases["bf16"], moe_utils.permute, moe_utils.unpermute)
    got = results["bf16"]
    for key in ("rows", "pprobs", "sorted_indices"):  # gathers: exact
        assert torch.equal(got[key], ref[key]), key
    for key in ("out", "grad_tokens", "grad_probs"):  # sums: fp32 accumulation vs bf16
        assert got[key].dtype == ref[key].dtype, key
        assert _rel(got[key], ref[key]) < BF16_RTOL, (key, _rel(got[key], ref[key]))


@needs_triton
@pytest.mark.parametrize("dispatcher", DISPATCHERS)
def test_interp_tiny_moe_model_fused_equals_unfused(interp, dispatcher):
    _, results = interp
    plain, fused = results["tiny"][dispatcher, False], results["tiny"][dispatcher, True]
    assert fused["dispatcher"].startswith("FusedPermute") and not plain["dispatcher"].startswith("FusedPermute")
    assert torch.equal(fused["logits"], plain["logits"]) and torch.equal(fused["loss"], plain["loss"])
    assert fused["grads"].keys() == plain["grads"].keys()
    experts = [n for n in plain["grads"] if "experts" in n]
    assert experts and all(plain["grads"][n].abs().sum() > 0 for n in experts)
    for n in plain["grads"]:
        assert torch.equal(fused["grads"][n], plain["grads"][n]), n


def test_flag_resolution_and_errors(monkeypatch):
    from megatron_glm5.arguments import args_to_overrides, parse_args
    from megatron_glm5.model.permute_fusion import MoEPermuteFusionUnavailable, moe_permute_fusion_enabled
    from test_arguments import fails, ok

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert moe_permute_fusion_enabled(None) is False and moe_permute_fusion_enabled(False) is False
    with pytest.raises(MoEPermuteFusionUnavailable, match="--moe-permute-fusion needs triton and a CUDA GPU"):
        moe_permute_fusion_enabled(True)
    err = fails(["--moe-permute-fusion"])
    assert str(err).startswith("--moe-permute-fusion needs a CUDA GPU") and err.flag == "--moe-permute-fusion"
    assert ok(["--no-moe-permute-fusion"]).moe_permute_fusion is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert moe_permute_fusion_enabled(None) is HAS_TRITON
    for argv, want in (([], None), (["--moe-permute-fusion"], True), (["--no-moe-permute-fusion"], False)):
        args = parse_args(argv)
        assert args.moe_permute_fusion is want
        assert args_to_overrides(args).get("moe_triton_permute_fusion") is want


# ----------------------------------------------------------------------------------------------------------------------
# GPU: GLM-5 sizes
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_glm5_sizes_match_unfused(dtype):
    """4096 tokens, hidden 6144, 256 experts, top-8. Gathers exact; sums: fp32 equal to an fp64 sum to fp32
    rounding (megatron's scatter_add order varies on a GPU), bf16 within 1e-2 of megatron."""
    from megatron.core.transformer.moe import moe_utils

    from megatron_glm5.ops import triton_moe_permute as fused

    g = torch.Generator().manual_seed(0)
    tokens, hidden, experts, topk = 4096, 6144, 256, 8
    case = {k: v.cuda() if torch.is_tensor(v) else v
            for k, v in _case(_topk_map(tokens, experts, topk, g), hidden, g, dtype=dtype).items()}
    got = pipeline(case, fused.permute, fused.unpermute)
    ref = pipeline(case, moe_utils.permute, moe_utils.unpermute)
    for key in ("rows", "pprobs", "sorted_indices"):
        assert torch.equal(got[key], ref[key]), key
    for key in ("out", "grad_tokens", "grad_probs"):
        tol = 1e-6 if dtype == torch.float32 else BF16_RTOL
        assert _rel(got[key], ref[key]) < tol, (key, _rel(got[key], ref[key]))
    # deterministic: a second run gives the same bits
    again = pipeline(case, fused.permute, fused.unpermute)
    assert all(torch.equal(again[k], got[k]) for k in got)


def test_building_a_moe_model_logs_the_permute_choice_once(caplog, monkeypatch):
    """Which token permute the MoE layers use is logged once per process (like the attention backend)."""
    import logging

    import megatron_glm5
    from megatron_glm5 import GLM5Config, build_model
    from megatron_glm5.model import moe

    megatron_glm5.initialize_model_parallel()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    moe._log_permute_choice.cache_clear()
    cfg = GLM5Config.from_preset("tiny").replace(num_hidden_layers=3, first_k_dense_replace=1)
    with caplog.at_level(logging.INFO, logger="megatron_glm5.model"):
        with torch.device("meta"):
            build_model(cfg, perform_initialization=False)
    said = [r.getMessage() for r in caplog.records if "MoE token permute" in r.getMessage()]
    assert said == ["MoE token permute/unpermute (alltoall dispatcher): megatron-core's unfused ops "
                    "(--no-moe-permute-fusion, or no CUDA GPU / triton)"]
