"""Numerical faults (megatron_glm5/training/numerics.py): a step whose loss or gradient is NaN/Inf on any rank is
skipped -- parameters and LR schedule untouched, its data consumed -- and logged with the iteration and the rank;
--max-skipped-steps consecutive skips stop the run with one line naming the iteration; loss spikes are logged and
written to TensorBoard. Faults come from the documented test hook $MEGATRON_GLM5_INJECT_FAULT (training/fault_hooks.py).

Training runs call finetune_glm5.py's main() in this process (tiny model, 24 conversations, seq 64); the
distributed case runs torchrun with 2 data-parallel ranks.
"""
from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_glm5.data import TINY_CHAT_TRAIN
from megatron_glm5.training.fault_hooks import FaultInjection
from megatron_glm5.training.numerics import LossSpikeDetector

REPO = Path(__file__).resolve().parents[1]
ENV = "MEGATRON_GLM5_INJECT_FAULT"


def _small_data(tmp_path, n=24) -> Path:
    lines = [x for x in Path(TINY_CHAT_TRAIN).read_text(encoding="utf-8").splitlines() if x.strip()][:n]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _flags(tmp_path, iters):
    data = _small_data(tmp_path)
    return ["--train-iters", str(iters), "--log-interval", "1", "--eval-iters", "0", "--no-save",
            "--micro-batch-size", "2", "--seq-length", "64", "--data-path", str(data), "--valid-data-path", str(data),
            "--tensorboard-dir", str(tmp_path / "tb")]


def _train(argv, fault, monkeypatch):
    """Exit status of finetune_glm5.py's main() with the fault hook set to ``fault``."""
    from megatron_glm5.training.entry import main

    monkeypatch.setenv(ENV, fault)
    for var in ("MEGATRON_GLM5_TRACEBACK", "RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    try:
        return main("finetune", argv)
    except SystemExit as e:
        return e.code


def _records(tb):
    return [json.loads(line) for line in (Path(tb) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _series(records, key):
    return {r["iteration"]: r[key] for r in records if key in r}


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# ------------------------------------------------------------------------------------------------ units


def test_fault_hook_grammar():
    f = FaultInjection.parse("nan-loss:2-4,9:1")
    assert (f.kind, sorted(f.iterations), f.rank) == ("nan-loss", [2, 3, 4, 9], 1)
    assert FaultInjection.parse("inf-grad:7") == FaultInjection("inf-grad", frozenset({7}), None)
    for bad in ("nan:3", "nan-grad", "nan-grad:x", "nan-grad:3:r1", "spike-loss:1:2:3"):
        with pytest.raises(Exception, match=ENV):
            FaultInjection.parse(bad)


def test_spike_detector_flags_the_spike_only():
    import random

    rng = random.Random(0)
    det = LossSpikeDetector(threshold=6.0, window=50)
    losses = [3.0 - 0.01 * i + rng.gauss(0, 0.02) for i in range(80)]  # a slowly falling, noisy loss
    losses[60] = 4.0  # +1.6 over the running mean: ~ 50 std
    flagged = [i for i, x in enumerate(losses) if det.update(i, x)]
    assert flagged == [60]
    assert det.count == 1
    # non-finite losses are not judged nor remembered; a threshold of 0 turns it off
    assert det.update(81, float("nan")) is None and math.isfinite(sum(det.history))
    off = LossSpikeDetector(threshold=0, window=50)
    assert not any(off.update(i, x) for i, x in enumerate(losses))
    # too little history: nothing is judged
    early = LossSpikeDetector(threshold=6.0, window=50)
    assert not any(early.update(i, x) for i, x in enumerate([1.0] * 9 + [100.0]))
    ready = LossSpikeDetector(threshold=6.0, window=50)
    assert not any(ready.update(i, x) for i, x in enumerate([1.0] * 10))
    assert ready.update(10, 100.0)


def test_spike_detector_std_floor():
    """A perfectly flat loss has std 0: a rise of 2% is not a spike (std is at least 1% of the mean)."""
    det = LossSpikeDetector(threshold=6.0, window=20)
    for i in range(20):
        det.update(i, 2.0)
    assert det.update(20, 2.04) is None
    assert det.update(21, 2.2) is not None


# ------------------------------------------------------------------------------------------------ training runs


def test_nan_gradient_step_is_skipped(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO)
    assert _train(_flags(tmp_path, 6), "nan-grad:3", monkeypatch) == 0
    warnings = _warnings(caplog)
    assert any("iteration 3: skipped the optimizer update: non-finite gradient on rank 0 (1 in a row; "
               "--max-skipped-steps 10)" in w for w in warnings), warnings
    records = _records(tmp_path / "tb")
    pnorm, lr, loss = _series(records, "params-norm"), _series(records, "learning-rate"), _series(records, "lm-loss")
    skipped, gnorm = _series(records, "skipped-steps"), _series(records, "grad-norm")
    assert sorted(loss) == list(range(1, 7))
    # the update of iteration 3 was not applied: parameters as after iteration 2, and the LR schedule did not
    # advance (the logged LR is the one a step's update uses: iteration 4 uses the LR iteration 3 would have used)
    assert pnorm[3] == pnorm[2] and lr[4] == lr[3] and lr[3] != lr[2]
    # ... and training goes on from there: updates, LR steps, finite numbers
    assert pnorm[4] != pnorm[3] and lr[5] != lr[4]
    assert all(math.isfinite(loss[i]) and math.isfinite(pnorm[i]) for i in loss)
    assert 3 not in gnorm and all(math.isfinite(gnorm[i]) for i in (1, 2, 4, 5, 6))
    assert [skipped[i] for i in range(1, 7)] == [0, 0, 1, 1, 1, 1]


def test_consecutive_nan_losses_stop_the_run(tmp_path, monkeypatch, caplog, capsys):
    rc = _train(_flags(tmp_path, 8) + ["--max-skipped-steps", "3"], "nan-loss:2-6", monkeypatch)
    assert rc == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: iteration 4: 3 consecutive steps skipped"), err
    assert "--max-skipped-steps 3" in err[0] and "non-finite loss on rank 0" in err[0], err
    loss = _series(_records(tmp_path / "tb"), "lm-loss")
    assert sorted(loss) == [1, 2, 3, 4] and math.isfinite(loss[1]) and all(math.isnan(loss[i]) for i in (2, 3, 4))


def test_skips_that_are_not_consecutive_do_not_stop(tmp_path, monkeypatch):
    assert _train(_flags(tmp_path, 6) + ["--max-skipped-steps", "2"], "inf-grad:2,4,6", monkeypatch) == 0
    assert _series(_records(tmp_path / "tb"), "skipped-steps")[6] == 3


def test_loss_spike_is_logged_and_written(tmp_path, monkeypatch, caplog):
    assert _train(_flags(tmp_path, 14), "spike-loss:12", monkeypatch) == 0
    spikes = [w for w in _warnings(caplog) if w.startswith("loss spike")]
    assert len(spikes) == 1 and spikes[0].startswith("loss spike at iteration 12: lm loss "), spikes
    records = _records(tmp_path / "tb")
    assert _series(records, "loss-spike") == {12: _series(records, "lm-loss")[12]}
    counts = _series(records, "loss-spikes")
    assert counts[11] == 0 and counts[12] == 1 and counts[14] == 1
    assert _series(records, "skipped-steps")[14] == 0  # a spike is finite: its update is applied


@pytest.mark.distributed
def test_nan_on_one_rank_skips_every_rank(tmp_path):
    """DP2: rank 1's gradients of iteration 2 are NaN (after the data-parallel reduction, so rank 0's are
    finite): both ranks skip the update, and the log names rank 1."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **{ENV: "nan-grad:2:1"})
    env.pop("MEGATRON_GLM5_TRACEBACK", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO / "finetune_glm5.py"), *_flags(tmp_path, 4), "--global-batch-size", "4"]
    proc = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=500)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "iteration 2: skipped the optimizer update: non-finite gradient on rank 1 (" in out, out[-4000:]
    pnorm = _series(_records(tmp_path / "tb"), "params-norm")
    assert pnorm[2] == pnorm[1] and pnorm[3] != pnorm[2]


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["bf16_optimizer", "bf16_distributed_optimizer"])
def test_guard_skips_the_bf16_optimizers(distributed_optimizer):
    """megatron-core's bf16 optimizers (fp32 master weights; distributed or not) report no overflow themselves:
    with the guard, a NaN gradient leaves the bf16 weights, the fp32 master weights and Adam's state untouched."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    from megatron_glm5 import platform
    from megatron_glm5.training.numerics import NonFiniteGuard

    platform.initialize_model_parallel(seed=3)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, bf16=True,
                               params_dtype=torch.bfloat16)

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = config
            self.lin = torch.nn.Linear(8, 8).to(torch.bfloat16)

    model = DistributedDataParallel(config=config, module=Tiny(), ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer))
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=1e-2, bf16=True, params_dtype=torch.bfloat16, clip_grad=1.0,
        use_distributed_optimizer=distributed_optimizer), [model])
    guard = NonFiniteGuard(max_consecutive=5).install(optimizer)

    def state():
        inner = optimizer.chained_optimizers[0].optimizer
        adam = [{k: v.clone() for k, v in s.items()} for s in inner.state.values()]
        master = [p.detach().clone() for g in inner.param_groups for p in g["params"]]
        return model.module.lin.weight.detach().clone(), master, adam

    results = []
    for iteration, poison in ((1, False), (2, True), (3, False)):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        model.module.lin(torch.ones(2, 8, dtype=torch.bfloat16)).float().pow(2).sum().backward()
        model.finish_grad_sync()
        if poison:
            for p in model.module.parameters():
                p.main_grad.fill_(float("nan"))
        guard.note_loss(iteration, [])
        before = state()
        ok, grad_norm, _ = optimizer.step()
        guard.after_step(iteration, ok)
        after = state()
        same = (torch.equal(before[0], after[0]) and all(torch.equal(a, b) for a, b in zip(before[1], after[1]))
                and all(torch.equal(a[k], b[k]) for a, b in zip(before[2], after[2]) for k in a))
        results.append((ok, grad_norm is None, same, bool(torch.isfinite(after[0]).all())))
    assert results == [(True, False, False, True), (False, True, True, True), (True, False, False, True)]
    assert guard.total == 1 and guard.consecutive == 0
