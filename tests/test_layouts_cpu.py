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

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
LAUNCH_TIMEOUT = 300

STEPS, RESUME_AT = 6, 3
TRAIN = ["--preset", "tiny", "--attn", "torch", "--seq-length", "64", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--lr-warmup-iters", "0", "--log-interval", "1", "--eval-iters", "0",
         "--seed", "1234"]
LOSS_RTOL = 1e-6
GRAD_NORM_RTOL = 5e-6

LAYOUTS = {
    "tp2-sp": ["--tp", "2", "--sequence-parallel"],
    "pp2": ["--pp", "2"],
    "ep2": ["--ep", "2"],
    "dp2-distopt": ["--use-distributed-optimizer"],
}


def _env():
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("MEGATRON_GLM5_DISABLE_SHIMS", None)
    return env


def _launch(nproc: int, script: str, args: list[str], log: Path):
    cmd = TORCHRUN + ["--nproc-per-node", str(nproc), script] + args
    with open(log, "w") as f:
        r = subprocess.run(cmd, cwd=REPO, env=_env(), stdout=f, stderr=subprocess.STDOUT, timeout=LAUNCH_TIMEOUT)
    if r.returncode:
        tail = log.read_text()[-4000:]
        pytest.fail(f"{' '.join(cmd)} exited with {r.returncode}; end of {log}:\n{tail}")


def _train(nproc: int, out: Path, *extra: str) -> dict:
    """Run finetune_glm5.py; {iteration: metrics} of the logged steps."""
    out.mkdir(parents=True, exist_ok=True)
    _launch(nproc, "finetune_glm5.py", TRAIN + ["--tensorboard-dir", str(out / "tb"), *extra], out / "log.txt")
    steps = {}
    for line in (out / "tb" / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "lm-loss" in rec:
            steps[rec["iteration"]] = rec
    return steps


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _assert_steps_match(run: dict, ref: dict, steps, what: str):
    assert sorted(run) == list(steps), f"{what}: logged iterations {sorted(run)}, expected {list(steps)}"
    loss = {i: _rel(run[i]["lm-loss"], ref[i]["lm-loss"]) for i in steps}
    gnorm = {i: _rel(run[i]["grad-norm"], ref[i]["grad-norm"]) for i in steps}
    print(f"{what}: max relative difference lm-loss {max(loss.values()):.2e}, grad-norm {max(gnorm.values()):.2e}")
    bad = {i: (run[i]["lm-loss"], ref[i]["lm-loss"]) for i in steps if loss[i] > LOSS_RTOL}
    assert not bad, f"{what}: lm-loss differs from the single-process run by more than {LOSS_RTOL:g} (run, ref): {bad}"
    bad = {i: (run[i]["grad-norm"], ref[i]["grad-norm"]) for i in steps if gnorm[i] > GRAD_NORM_RTOL}
    assert not bad, f"{what}: grad norm differs by more than {GRAD_NORM_RTOL:g} (run, ref): {bad}"


# ---------------------------------------------------------------------------------------------------------------
# Training: layouts and resume
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(start checkpoint, reference checkpoint root, reference steps {iteration: metrics}, work directory)."""
    root = tmp_path_factory.mktemp("layouts")
    start = root / "start"
    _train(1, root / "start_run", "--train-iters", "1", "--save", str(start))
    ref_ckpt = root / "ref_ckpt"
    ref = _train(1, root / "ref", "--load", str(start), "--finetune", "--train-iters", str(STEPS),
                 "--save", str(ref_ckpt), "--save-interval", str(RESUME_AT))
    assert sorted(ref) == list(range(1, STEPS + 1))
    assert (ref_ckpt / f"iter_{RESUME_AT:07d}").is_dir()
    return start, ref_ckpt, ref, root


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(reference, layout):
    start, _, ref, root = reference
    run = _train(2, root / layout, "--load", str(start), "--finetune", "--train-iters", str(STEPS), "--no-save",
                 *LAYOUTS[layout])
    _assert_steps_match(run, ref, range(1, STEPS + 1), layout)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["tp2-sp", "pp2"])
def test_resume_single_process_checkpoint_at_another_layout(reference, layout):
    _, ref_ckpt, ref, root = reference
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


# ---------------------------------------------------------------------------------------------------------------
# Pipeline splits and IndexShare (in process: only the layer specs are built)
# ---------------------------------------------------------------------------------------------------------------


def test_pipeline_stage_starting_with_a_shared_indexer_layer_is_refused_clearly():
    """tiny-indexshare is F S F S: PP2 keeps each shared layer with its full layer; PP4 (or PP2 x VPP2) would give
    stage 1 a shared layer whose top-k is computed on stage 0, which is not implemented: refused before the model
    is built, by every rank alike (check_pipeline_split looks at all stages)."""
    from megatron_glm5.config import GLM5Config
    from megatron_glm5.errors import UserError
    from megatron_glm5.model.spec import check_pipeline_split, decoder_block_spec

    cfg = GLM5Config.from_preset("tiny-indexshare")
    assert list(cfg.indexer_types) == ["full", "shared", "full", "shared"]
    pp2 = cfg.to_transformer_config(pipeline_model_parallel_size=2)
    check_pipeline_split(pp2)
    assert [len(decoder_block_spec(pp2, pp_rank=r).layer_specs) for r in range(2)] == [2, 2]
    pp4 = cfg.to_transformer_config(pipeline_model_parallel_size=4)
    with pytest.raises(UserError, match=r"--pp 4: pipeline stage 1 .* layer 1 is an IndexShare .* full layer 0"):
        check_pipeline_split(pp4)
    vpp = cfg.to_transformer_config(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    with pytest.raises(UserError, match=r"--pp 2 --vpp 2: pipeline stage 1 \(virtual stage 0\)"):
        check_pipeline_split(vpp)
    tiny = GLM5Config.from_preset("tiny").to_transformer_config(pipeline_model_parallel_size=4)
    check_pipeline_split(tiny)
    assert all(len(decoder_block_spec(tiny, pp_rank=r).layer_specs) == 1 for r in range(4))
