"""--optimizer muon at parallel layouts on CPU (gloo): the same 6 steps as one process, and a bitwise resume.

All runs load the layout tests' shared starting point (tests/layouts_harness.py: a one-process run's step-1 weights,
``--load <it> --finetune``) and train 6 steps with Muon:
- the reference: one process, saving at step 3; resumed from that checkpoint, steps 4-6 are the same bit for bit
  (loss and gradient norm);
- TP2 (sequence parallel) x PP2 in one 4-process launch: TP-sharded matrices that are not split per head are
  gathered, orthogonalised whole and sliced back; the per-head blocks are each rank's own heads;
- EP2 x DP2 with --use-distributed-optimizer (megatron-core's layer-wise distributed optimizer: whole parameters
  sharded over the data-parallel ranks, gathered after the step) in one 2-process launch;
each within 1e-6 relative of the reference in every step's loss (gradient norms within 5e-6).
Measured (2026-12-01, this CPU machine): TP2xPP2 loss within 8.4e-8, grad norm 4.0e-7; EP2xDP2 8.0e-8, 1.6e-7.
"""
from __future__ import annotations

import pytest

from layouts_harness import RESUME_AT, STEPS, _assert_steps_match, _train

MUON = ["--optimizer", "muon"]


@pytest.fixture(scope="module")
def muon_reference(layouts_reference, tmp_path_factory):
    start = layouts_reference[0]
    root = tmp_path_factory.mktemp("muon_layouts")
    ref = _train(1, root / "ref", "--load", str(start), "--finetune", "--train-iters", str(STEPS), *MUON,
                 "--save", str(root / "ref_ckpt"), "--save-interval", str(RESUME_AT))
    assert sorted(ref) == list(range(1, STEPS + 1))
    return start, root, ref


@pytest.mark.distributed
def test_muon_resume_is_bitwise(muon_reference):
    _, root, ref = muon_reference
    run = _train(1, root / "resume", "--load", str(root / "ref_ckpt" / f"iter_{RESUME_AT:07d}"),
                 "--train-iters", str(STEPS), "--no-save", *MUON)
    assert sorted(run) == list(range(RESUME_AT + 1, STEPS + 1))
    for i in run:
        assert (run[i]["lm-loss"], run[i]["grad-norm"]) == (ref[i]["lm-loss"], ref[i]["grad-norm"]), i


@pytest.mark.distributed
@pytest.mark.parametrize("nproc, layout", [
    (4, ["--tp", "2", "--sequence-parallel", "--pp", "2"]),
    (2, ["--ep", "2", "--use-distributed-optimizer"]),
], ids=["tp2-sp-pp2", "ep2-dp2-distopt"])
def test_muon_layout_matches_single_process(muon_reference, nproc, layout):
    start, root, ref = muon_reference
    name = "-".join(a.strip("-") for a in layout)
    run = _train(nproc, root / name, "--load", str(start), "--finetune", "--train-iters", str(STEPS), "--no-save",
                 *MUON, *layout)
    _assert_steps_match(run, ref, range(1, STEPS + 1), f"muon {name}")
