"""Parallel layouts on CPU (gloo, 2 processes) reproduce the single-process run of the tiny model.

Training (finetune_glm5.py under torchrun, fp32, the shipped SFT data, seq 64, global batch 4 = micro-batches of 2):
- one shared starting point: a one-process run trains 1 step and saves; every run below loads its weights with
  ``--load <it> --finetune`` (weights only: fresh optimizer, schedule and data position), so all of them start
  from the same weights (a fresh init differs per layout: PP and EP stages draw from other RNG streams);
- the reference: one process, 6 steps, saving at step 3;
- TP2 (sequence parallel), PP2, EP2, DP2 with the distributed optimizer: 6 steps each; the LM loss of every step
  within 1e-6 relative of the reference, the gradient norm within 5e-6 relative;
- resume at another layout: TP2 and PP2 load the reference's step-3 checkpoint (optimizer state resharded) and
  train steps 4..6, again within 1e-6 of the reference.
Measured (2026-11-30, this CPU machine): largest loss difference 1.7e-7 relative (TP2 step 6; PP2/EP2/DP2 and both
resumes 0 to 8.7e-8), gradient norms within 1e-6. What differs is the order of fp32 additions (row-parallel
partial sums, all-reduces); a step's loss is itself an fp32 sum over at most 256 tokens (rounding ~6e-8 relative).
The runs are deterministic; DSA is sparse (top-16 of up to 64 keys) and MoE routes top-2 of 8, so a near-tie
flipped by such rounding would show as a jump far above 1e-6: none occurs in these steps.

Losses cannot see every gradient bug: Adam's update is invariant to a constant factor on a parameter's gradient
(with q_layernorm's gradient doubled at TP2, the first 5 losses stayed within 3e-7, the 6th 1.1e-6; the gradient
norm moved by up to 4e-5, which GRAD_NORM_RTOL catches). So the gradients are compared directly too
(tests/layouts_grad_tool.py: one forward/backward through megatron-core's schedule, DDP and
finalize_model_grads, every parameter's gradient gathered back to the single-process shape), including the shared
RoPE key rows of linear_kv_down_proj that megatron-core's own non-TE MLA leaves unsummed over TP — and each
of those checks is shown to fail with the fix taken out.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from layouts_harness import RESUME_AT, STEPS, _assert_steps_match, _launch, _train

LAYOUTS = {
    "tp2-sp": ["--tp", "2", "--sequence-parallel"],
    "pp2": ["--pp", "2"],
    "ep2": ["--ep", "2"],
    "dp2-distopt": ["--use-distributed-optimizer"],
}


# ---------------------------------------------------------------------------------------------------------------
# Training: layouts and resume
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layouts_reference, layout):
    start, _, ref, root = layouts_reference
    run = _train(2, root / layout, "--load", str(start), "--finetune", "--train-iters", str(STEPS), "--no-save",
                 *LAYOUTS[layout])
    _assert_steps_match(run, ref, range(1, STEPS + 1), layout)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["tp2-sp", "pp2"])
def test_resume_single_process_checkpoint_at_another_layout(layouts_reference, layout):
    _, ref_ckpt, ref, root = layouts_reference
    out = root / f"resume-{layout}"
    run = _train(2, out, "--load", str(ref_ckpt / f"iter_{RESUME_AT:07d}"), "--train-iters", str(STEPS),
                 "--no-save", *LAYOUTS[layout])
    _assert_steps_match(run, ref, range(RESUME_AT + 1, STEPS + 1), f"resume {layout}")


# ---------------------------------------------------------------------------------------------------------------
# Gradients, parameter by parameter
# ---------------------------------------------------------------------------------------------------------------

GRAD_TOOL = "tests/layouts_grad_tool.py"
GRAD_RTOL = 1e-5
# The lightning indexers' gradients come from their KL loss (coefficient 1e-3), a difference of two nearly equal
# distributions: the target (attention probabilities summed over heads) is summed over 2 + 2 heads and all-reduced
# at TP2 instead of over 4 heads, and the cancellation in (indexer - target) turns that 1e-7 reordering into up to
# 2e-5 of these tiny gradients (norms 1e-9 .. 1e-6). Everything else stays within 5e-7.
INDEXER_GRAD_RTOL = 1e-4


def _grads(out: Path, variant: str) -> dict:
    """Merge the ranks' gathered gradients; ranks holding the same parameter must agree."""
    merged = {}
    files = sorted(out.glob(f"{variant}.rank*.pt"))
    assert files, f"no {variant}.rank*.pt in {out}"
    for f in files:
        for name, g in torch.load(f).items():
            if name in merged:
                assert torch.allclose(merged[name], g, rtol=1e-6, atol=0), f"{f.name}: ranks disagree on {name}"
            else:
                merged[name] = g
    return merged


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def _mismatches(got: dict, ref: dict) -> dict:
    assert set(got) == set(ref), f"parameters differ: {sorted(set(got) ^ set(ref))[:5]}"
    out = {}
    for name, r in ref.items():
        assert got[name].shape == r.shape, f"{name}: shape {tuple(got[name].shape)} vs {tuple(r.shape)}"
        tol = INDEXER_GRAD_RTOL if ".indexer." in name else GRAD_RTOL
        err = _rel_err(got[name], r)
        if not err <= tol:
            out[name] = err
    return out


@pytest.fixture(scope="module")
def grad_reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("grads")
    weights = root / "weights"
    _launch(1, GRAD_TOOL, ["--out", str(root / "ref"), "--weights", str(weights)], root / "ref.log")
    return root, weights, _grads(root / "ref", "ok")


def _grad_run(grad_reference, name: str, layout: list[str], variants: str = "ok") -> Path:
    root, weights, _ = grad_reference
    out = root / name
    _launch(2, GRAD_TOOL, ["--out", str(out), "--weights", str(weights), "--variants", variants, *layout],
            root / f"{name}.log")
    return out


def _kv_down_rows(grads: dict, cfg_lat: int):
    return {n: (g[:cfg_lat], g[cfg_lat:]) for n, g in grads.items() if n.endswith("linear_kv_down_proj.weight")}


@pytest.mark.distributed
def test_tp2_gradients_match_and_the_checks_can_fail(grad_reference):
    """TP2 + sequence parallel: every gradient matches one process; with the shared RoPE key's gradient left
    unsummed over TP (megatron-core's non-TE MLA) its rows of linear_kv_down_proj are wrong; with q_layernorm's
    gradient summed over TP by megatron-core's finalize_model_grads (before our fix) it is doubled."""
    from megatron_glm5.config import GLM5Config

    _, _, ref = grad_reference
    out = _grad_run(grad_reference, "tp2", ["--tp", "2"], "ok,krope_unsummed,qnorm_tp_summed")
    lat = GLM5Config.from_preset("tiny").kv_lora_rank

    ok = _grads(out, "ok")
    assert not _mismatches(ok, ref)
    ref_rows, ok_rows = _kv_down_rows(ref, lat), _kv_down_rows(ok, lat)
    assert len(ref_rows) == 5  # 4 decoder layers + MTP
    for name, (latent, k_rope) in ok_rows.items():
        assert _rel_err(k_rope, ref_rows[name][1]) < GRAD_RTOL, name
        assert _rel_err(latent, ref_rows[name][0]) < GRAD_RTOL, name

    # the same check without the TP sum of the shared key's gradient: its rows are far off (~0.7 measured)
    unsummed = _kv_down_rows(_grads(out, "krope_unsummed"), lat)
    for name, (_, k_rope) in unsummed.items():
        assert _rel_err(k_rope, ref_rows[name][1]) > 0.1, f"{name}: the unsummed k_rope gradient went unnoticed"

    # without average_gradients_across_tp_domain on the latent norms: q_layernorm's gradient doubles
    summed = _grads(out, "qnorm_tp_summed")
    qnorm = [n for n in ref if n.endswith("q_layernorm.weight")]
    assert len(qnorm) == 5
    for name in qnorm:
        assert torch.allclose(summed[name], 2 * ref[name], rtol=1e-4, atol=0), name
    assert set(_mismatches(summed, ref)) == set(qnorm)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [["--ep", "2"], ["--pp", "2"]], ids=["ep2", "pp2"])
def test_gradients_match_single_process(grad_reference, layout):
    _, _, ref = grad_reference
    out = _grad_run(grad_reference, "".join(layout).replace("-", ""), layout)
    assert not _mismatches(_grads(out, "ok"), ref)
