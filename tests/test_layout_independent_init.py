"""The same --seed gives the same initial model at every layout (megatron_glm5/model/init.py): the validation loss
of a from-scratch run before its first step is the same in one process and at TP2, PP2, EP2 and CP2 (it used to be
6.2722 at PP2 against 6.2206 elsewhere: megatron-core draws a stage's weights from where its own layers start)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from layouts_harness import REPO, TORCHRUN, _env

FLAGS = ["--train-iters", "1", "--lr-warmup-iters", "0", "--eval-iters", "2", "--log-interval", "1",
         "--micro-batch-size", "4", "--global-batch-size", "8", "--no-save", "--seed", "77"]


def _initial_validation_loss(tmp_path, name, nproc, *layout):
    tb = tmp_path / name
    cmd = (TORCHRUN + ["--nproc-per-node", str(nproc)] if nproc > 1 else [sys.executable])
    cmd = cmd + [str(REPO / "finetune_glm5.py"), *FLAGS, "--tensorboard-dir", str(tb), *layout]
    r = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{name}: {r.stderr[-3000:]}"
    records = [json.loads(line) for line in (tb / "metrics.jsonl").read_text().splitlines()]
    (loss,) = [r["validation/lm-loss"] for r in records if r["iteration"] == 0 and "validation/lm-loss" in r]
    return loss


@pytest.mark.distributed
@pytest.mark.slow
def test_initial_model_is_the_same_at_every_layout(tmp_path):
    ref = _initial_validation_loss(tmp_path, "one_process", 1)
    losses = {name: _initial_validation_loss(tmp_path, name, 2, *flags)
              for name, flags in (("tp2", ["--tp", "2"]), ("pp2", ["--pp", "2"]), ("ep2", ["--ep", "2"]),
                                  ("cp2", ["--cp", "2"]))}
    off = {name: (loss, ref) for name, loss in losses.items() if abs(loss - ref) > 1e-6 * abs(ref)}
    assert not off, f"initial validation loss differs from one process's {ref}: {off}"


def test_redrawn_weights_keep_each_tensors_init_distribution():
    """The redraw uses the model's own init function per tensor (output projections the scaled one) and leaves
    constants alone; a fixed seed gives fixed values."""
    import torch

    from megatron_glm5 import GLM5Config, build_model
    from megatron_glm5.model.init import initialize_by_global_identity

    model = build_model(GLM5Config.from_preset("tiny"), mtp=False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    initialize_by_global_identity(model, 5)
    first = {n: p.detach().clone() for n, p in model.named_parameters()}
    initialize_by_global_identity(model, 5)
    for n, p in model.named_parameters():
        assert torch.equal(p, first[n]), n  # the seed alone decides
        if torch.equal(before[n], before[n].reshape(-1)[0].expand_as(before[n])):
            assert torch.equal(p, before[n]), f"{n}: a constant tensor was redrawn"
        else:
            assert not torch.equal(p, before[n]), n
            ratio = p.std().item() / before[n].std().item()
            assert 0.8 < ratio < 1.25, (n, ratio)  # same init std (0.02, or the output layers' scaled one)
