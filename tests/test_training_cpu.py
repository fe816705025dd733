"""The training entry points, run for real: `python finetune_glm5.py` / `python pretrain_glm5.py` in subprocesses
(OMP_NUM_THREADS=1, cwd a temporary directory), plus one in-process check of sequence packing.

What they must do: the flag-less default trains (validation loss falls) and leaves checkpoints and TensorBoard
scalars; a resumed run repeats the uninterrupted one bitwise; SIGTERM saves and exits 0; the DSA dense warm-up
trains the indexer alone and hands over to the sparse stage with one flag; and bad input stops the run with one
line `error: ...` that names the file:line or the flag, without a traceback or a checkpoint.
"""
from __future__ import annotations

import json
import math
import shutil
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from training_helpers import (assert_user_error, check_ok, describe, event_scalars, latest_iteration, only_run_dir,
                              read_metrics, run_entries, run_entry, series, start_entry)

from megatron_glm5.data import TINY_CHAT_TRAIN, TINY_TOKENIZER_DIR

TB_SCALARS = ("lm-loss", "indexer-kl-loss", "mtp-loss", "expert-load-imbalance", "learning-rate", "grad-norm",
              "params-norm", "tokens-per-second", "tflops-per-gpu", "memory-gib", "validation/lm-loss")
# run A: 12 iterations, a checkpoint every 6; run B: the same, exiting (and saving) at 6; run C: B resumed to 12
RESUME_FLAGS = ["--train-iters", "12", "--log-interval", "1", "--save-interval", "6", "--eval-interval", "6",
                "--eval-iters", "1"]
PEAK_TFLOPS = 100.0
# quick runs that only need to start training (bad-input cases that must proceed)
QUICK = ["--train-iters", "2", "--log-interval", "1", "--eval-iters", "0", "--no-save"]


def _mean(values):
    values = list(values)
    return sum(values) / len(values)


def _chat_lines(n: int):
    lines = [line for line in Path(TINY_CHAT_TRAIN).read_text(encoding="utf-8").splitlines() if line.strip()]
    return lines[:n]


def _write(path: Path, text) -> Path:
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------------ shared runs


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory):
    """{mode: runs A, B and C} for finetune and pretrain, each mode in its own directory. The four independent
    runs A and B go at once, then the two runs C (the machine has at least 2 cores; each run uses one)."""
    roots = {mode: tmp_path_factory.mktemp(f"resume_{mode}") for mode in ("finetune", "pretrain")}
    # pretraining runs with the distributed optimizer, so its resume covers the sharded optimizer state too
    flags = {"finetune": RESUME_FLAGS, "pretrain": RESUME_FLAGS + ["--use-distributed-optimizer"]}
    first = run_entries([(mode, flags[mode] + extra, roots[mode]) for mode in roots for extra in
                         (["--save", "A", "--peak-tflops", str(PEAK_TFLOPS)], ["--save", "B", "--exit-interval", "6"])])
    for proc in first:
        check_ok(proc)
    # the resumed runs C also take --manual-gc (collector off, collections after every 2nd step, before saves and
    # evaluation): the resume tests then also say that it changes no number
    second = run_entries([(mode, flags[mode] + ["--load", "B", "--save", "C", "--manual-gc", "--manual-gc-interval",
                                                "2"], roots[mode]) for mode in roots])
    for proc in second:
        check_ok(proc)
    return {mode: SimpleNamespace(root=roots[mode], a=first[2 * i], b=first[2 * i + 1], c=second[i])
            for i, mode in enumerate(roots)}


# A test's first run, when it depends on nothing, starts with the module (when the test is selected), two at a time
# on a thread pool (each run uses one core), so that it overlaps the other tests; the test collects it. The
# flag-less default run (~90 s of one core) gains most: its test is last in the file.
WARMUP_FLAGS = ["--dsa-indexer-loss-coeff", "1", "--log-interval", "1", "--eval-iters", "0", "--save", "W"]
FIRST_RUNS = {
    "test_default_finetune_run_trains_and_saves": ("finetune", []),
    "test_dense_warmup_trains_indexer_then_sparse_resumes":
        ("finetune", WARMUP_FLAGS + ["--dsa-stage", "dense-warmup", "--train-iters", "24"]),
    "test_load_checkpoint_of_another_model_names_the_field":
        ("finetune", ["--train-iters", "1", "--eval-iters", "0", "--no-mtp", "--save", "ckpt"]),
}
_started = {}


@pytest.fixture(scope="module", autouse=True)
def _start_first_runs(request, tmp_path_factory):
    selected = {item.name for item in request.session.items if item.module is request.module}
    pool = ThreadPoolExecutor(max_workers=2)
    for name, (mode, args) in FIRST_RUNS.items():
        if name in selected:
            workdir = tmp_path_factory.mktemp(name[len("test_"):][:24])
            _started[name] = (pool.submit(run_entry, mode, args, workdir, 900), workdir)
    yield
    pool.shutdown(wait=True)  # a test that failed early leaves its run to finish (run_entry has a timeout)


def _first_run(name: str, tmp_path):
    """(CompletedProcess, working directory) of a test's first run: the one started with the module, or one run
    now in tmp_path."""
    if name in _started:
        job, workdir = _started.pop(name)
        return job.result(), workdir
    mode, args = FIRST_RUNS[name]
    Path(tmp_path).mkdir(parents=True, exist_ok=True)
    return run_entry(mode, args, tmp_path, 900), tmp_path


# ------------------------------------------------------------------------------------------------ 2. TensorBoard


def test_tensorboard_scalars(resume_runs):
    runs = resume_runs["finetune"]
    tb = runs.root / "A" / "tensorboard"
    ea = event_scalars(tb)
    tags = set(ea.Tags()["scalars"])
    missing = [t for t in TB_SCALARS + ("mfu",) if t not in tags]
    assert not missing, f"missing scalars {missing}; have {sorted(tags)}"
    assert [e.step for e in ea.Scalars("lm-loss")] == list(range(1, 13))
    assert [e.step for e in ea.Scalars("validation/lm-loss")] == [0, 6, 12]
    records = read_metrics(tb)
    for tag in TB_SCALARS + ("mfu",):
        full = series(records, tag)
        for event in ea.Scalars(tag):  # the events hold float32 copies of metrics.jsonl's values
            assert math.isfinite(event.value)
            assert event.value == pytest.approx(full[event.step], rel=1e-6, abs=1e-12), (tag, event.step)
    for it in range(1, 13):
        assert series(records, "tokens-per-second")[it] > 0 and series(records, "memory-gib")[it] > 0
        assert series(records, "mfu")[it] == pytest.approx(series(records, "tflops-per-gpu")[it] / PEAK_TFLOPS)
    # without --peak-tflops a CPU run has no MFU
    assert "mfu" not in set(event_scalars(runs.root / "C" / "tensorboard").Tags()["scalars"])


# ------------------------------------------------------------------------------------------------ 3. resume


@pytest.mark.parametrize("mode", ["finetune", "pretrain"])
def test_resume_is_bitwise(resume_runs, mode):
    runs = resume_runs[mode]
    root = runs.root
    assert "exiting at iteration 6" in runs.b.stdout, describe(runs.b)
    assert latest_iteration(root / "B") == 6 and not (root / "B" / "iter_0000012").exists()
    assert "at iteration 6" in runs.c.stdout and "resumed from" in runs.c.stdout, describe(runs.c)
    assert latest_iteration(root / "C") == 12
    a = read_metrics(root / "A" / "tensorboard")
    b = read_metrics(root / "B" / "tensorboard")
    c = read_metrics(root / "C" / "tensorboard")
    assert sorted(series(c, "lm-loss")) == list(range(7, 13)), "C must continue at iteration 7"
    for key in ("lm-loss", "mtp-loss", "grad-norm", "params-norm", "learning-rate"):
        sa, sb, sc = series(a, key), series(b, key), series(c, key)
        assert [sb[i] for i in range(1, 7)] == [sa[i] for i in range(1, 7)], key
        assert [sc[i] for i in range(7, 13)] == [sa[i] for i in range(7, 13)], (key, sa, sc)
    assert series(c, "validation/lm-loss")[12] == series(a, "validation/lm-loss")[12]
    # the logged learning rate is the one the step's update used: 12 iterations warm up over 1 (train_iters // 10)
    # from 0, so step 1 updates with lr 0 and step 2 with the peak (the default --lr 3e-3)
    lr = series(a, "learning-rate")
    assert lr[1] == 0.0 and lr[2] == pytest.approx(3e-3), lr


def test_resume_lr_schedule_from_checkpoint_or_flags(resume_runs, tmp_path):
    """A resumed run follows the checkpoint's LR schedule and warns when --lr/--min-lr ask for another;
    --override-opt-param-scheduler takes the flags' schedule, keeping the restored step count."""
    root = resume_runs["finetune"].root
    a = series(read_metrics(root / "A" / "tensorboard"), "learning-rate")
    common = RESUME_FLAGS[2:] + ["--load", str(root / "B"), "--no-save", "--train-iters", "8", "--eval-iters", "0",
                                 "--lr", "1e-3", "--min-lr", "1e-4"]
    kept, overridden = run_entries([
        ("finetune", common + ["--tensorboard-dir", "kept"], tmp_path),
        ("finetune", common + ["--tensorboard-dir", "over", "--override-opt-param-scheduler"], tmp_path)])
    check_ok(kept), check_ok(overridden)
    assert "resuming with the checkpoint's learning-rate schedule, not --lr 0.001 (checkpoint: 0.003)" in \
        kept.stdout + kept.stderr, describe(kept)
    assert series(read_metrics(tmp_path / "kept"), "learning-rate")[7] == a[7]
    # the flags' cosine schedule over 8 iterations without warm-up (8 // 10 = 0), at step 7 (6 steps done):
    # min + (max - min) * (1 + cos(pi * 6 / 8)) / 2
    expected = 1e-4 + (1e-3 - 1e-4) * (1 + math.cos(math.pi * 6 / 8)) / 2
    assert series(read_metrics(tmp_path / "over"), "learning-rate")[7] == pytest.approx(expected, rel=1e-9)


# ------------------------------------------------------------------------------------------------ 4. SIGTERM


def test_sigterm_saves_checkpoint_and_resume_continues(tmp_path):
    flags = ["--train-iters", "1000", "--log-interval", "1", "--eval-iters", "0", "--save", "S"]
    with open(tmp_path / "stderr.txt", "w+") as err:
        proc = start_entry("finetune", flags, tmp_path, stderr=err)
        watchdog = threading.Timer(300, proc.kill)
        watchdog.start()
        seen = []
        try:
            for line in proc.stdout:
                seen.append(line)
                if "lm loss" in line:
                    proc.send_signal(signal.SIGTERM)
                    break
            rest, _ = proc.communicate(timeout=300)
        finally:
            watchdog.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        err.seek(0)
        stderr = err.read()
    out = "".join(seen) + rest
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{out[-3000:]}\n{stderr[-3000:]}"
    assert "received SIGTERM" in out, out[-3000:]
    k = latest_iteration(tmp_path / "S")
    assert 1 <= k < 1000 and (tmp_path / "S" / f"iter_{k:07d}" / "metadata.json").is_file()
    assert max(series(read_metrics(tmp_path / "S" / "tensorboard"), "lm-loss")) == k
    assert not list((tmp_path / "S").glob("*.partial"))

    resumed = check_ok(run_entry("finetune", flags + ["--load", "S", "--exit-interval", str(k + 1)], tmp_path))
    assert f"at iteration {k}" in resumed.stdout, describe(resumed)
    assert f"iter {k + 1}/1000" in resumed.stdout and "iter 1/1000" not in resumed.stdout, describe(resumed)
    assert latest_iteration(tmp_path / "S") == k + 1


# ------------------------------------------------------------------------------------------------ 5. DSA stages


def test_dense_warmup_trains_indexer_then_sparse_resumes(tmp_path):
    """--dsa-stage dense-warmup --dsa-indexer-loss-coeff 1 for 24 iterations, then --load ... --dsa-stage sparse."""
    proc, workdir = _first_run("test_dense_warmup_trains_indexer_then_sparse_resumes", tmp_path)
    check_ok(proc)
    warm = read_metrics(workdir / "W" / "tensorboard")
    kl, lm, gn = series(warm, "indexer-kl-loss"), series(warm, "lm-loss"), series(warm, "grad-norm")
    assert sorted(kl) == list(range(1, 25))
    first, last = _mean(kl[i] for i in (1, 2)), _mean(kl[i] for i in range(21, 25))
    assert last < 0.5 * first, f"indexer KL did not fall: {kl}"
    # the warm-up trains the indexer alone: the LM loss stays where the untrained model has it
    assert max(lm.values()) - min(lm.values()) < 0.1, lm
    assert latest_iteration(workdir / "W") == 24

    sparse_flags = WARMUP_FLAGS + ["--dsa-stage", "sparse", "--train-iters", "30", "--load", "W"]
    sparse = check_ok(run_entry("finetune", sparse_flags, workdir))
    assert "at iteration 24" in sparse.stdout and "DSA sparse" in sparse.stdout, describe(sparse)
    assert "optimizer state starts fresh" in sparse.stdout, describe(sparse)
    records = read_metrics(workdir / "W" / "tensorboard")
    kl2, gn2 = series(records, "indexer-kl-loss"), series(records, "grad-norm")
    assert all(it in kl2 and math.isfinite(kl2[it]) and kl2[it] >= 0 for it in range(25, 31)), kl2
    # now the whole model trains again: gradients far larger than the indexer's alone
    assert min(gn2[it] for it in range(25, 31)) > 10 * max(gn.values()), (gn, gn2)
    assert latest_iteration(workdir / "W") == 30


# ------------------------------------------------------------------------------------------------ 6. pretraining


def test_pretraining_loss_falls(resume_runs):
    runs = resume_runs["pretrain"]
    assert ".bin/.idx" in runs.a.stdout, describe(runs.a)  # the shipped jsonl was preprocessed on the fly
    lm = series(read_metrics(runs.root / "A" / "tensorboard"), "lm-loss")
    assert lm[12] < 0.9 * lm[1], lm


# ------------------------------------------------------------------------------------------------ 7. packing


def test_packed_documents_match_separate_runs():
    """Three documents longer than index_topk packed into one THD row give each document's per-token losses."""
    import torch

    import megatron_glm5
    from megatron_glm5 import GLM5Config
    from megatron_glm5.data.packing import make_packed_seq_params, pack_sequences

    megatron_glm5.initialize_model_parallel(seed=7)
    cfg = GLM5Config.from_preset("tiny")
    model = megatron_glm5.build_model(cfg, mtp=False).eval()
    topk = model.config.dsa_index_topk
    assert topk == 16
    lengths = (23, 41, 57)
    assert min(lengths) > topk
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(1, cfg.vocab_size, (n,), generator=g) for n in lengths]
    seq = 128
    rows = pack_sequences(docs, seq, pad_id=0)
    assert len(rows) == 1
    row = rows[0]
    assert row["cu_seqlens"].tolist() == [0, 23, 64, 121, 128]
    with torch.no_grad():
        packed = model(row["tokens"], row["position_ids"], None, labels=row["labels"],
                       packed_seq_params=make_packed_seq_params(row["cu_seqlens"], seq))
        assert packed.shape == (1, seq)
        start = 0
        for doc in docs:
            n = doc.numel()
            labels = torch.cat([doc[1:], doc.new_zeros(1)]).unsqueeze(0)
            alone = model(doc.unsqueeze(0), torch.arange(n).unsqueeze(0), None, labels=labels)
            assert alone.shape == (1, n)
            # the last token of a document predicts nothing (its label is padding in both layouts)
            torch.testing.assert_close(packed[0, start:start + n - 1], alone[0, :n - 1], rtol=0, atol=1e-5)
            start += n


# ------------------------------------------------------------------------------------------------ 8. bad input


def test_missing_data_path_is_a_flag_error(tmp_path):
    missing = tmp_path / "nowhere.jsonl"
    proc = run_entry("finetune", ["--data-path", missing], tmp_path)
    assert_user_error(proc, "--data-path", str(missing), "no such file", workdir=tmp_path)


def test_empty_data_file(tmp_path):
    empty = _write(tmp_path / "empty.jsonl", "")
    proc = run_entry("finetune", ["--data-path", empty], tmp_path)
    assert_user_error(proc, str(empty), "empty", workdir=tmp_path)


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    good = _chat_lines(3)
    data = _write(tmp_path / "chat.jsonl", "\n".join(good[:2] + ['{"messages": [oops'] + good[2:]) + "\n")
    proc = run_entry("finetune", ["--data-path", data], tmp_path)
    assert_user_error(proc, f"{data}:3:", "malformed JSON", workdir=tmp_path)


def test_malformed_jsonl_line_skipped_with_flag(tmp_path):
    good = _chat_lines(3)
    data = _write(tmp_path / "chat.jsonl", "\n".join(good[:2] + ['{"messages": [oops'] + good[2:]) + "\n")
    proc = check_ok(run_entry("finetune", QUICK + ["--data-path", data, "--skip-bad-samples"], tmp_path))
    assert "skipped 1 bad lines (malformed_json 1)" in proc.stdout, describe(proc)
    assert f"{data}:3:" in proc.stdout and "iter 2/2" in proc.stdout, describe(proc)


def test_non_utf8_bytes_name_file_and_line(tmp_path):
    good = [line.encode("utf-8") for line in _chat_lines(2)]
    latin1 = '{"messages": [{"role": "user", "content": "caf\xe9?"}, {"role": "assistant", "content": "Oui."}]}'
    data = _write(tmp_path / "chat.jsonl", b"\n".join([good[0], latin1.encode("latin-1"), good[1]]) + b"\n")
    proc = run_entry("finetune", ["--data-path", data], tmp_path)
    assert_user_error(proc, f"{data}:2:", "UTF-8", workdir=tmp_path)


def test_overlong_sample_dropped_or_truncated(tmp_path):
    long_chat = {"messages": [{"role": "user", "content": "Count words."},
                              {"role": "assistant", "content": " ".join(f"word{i}" for i in range(200))}]}
    data = _write(tmp_path / "chat.jsonl", "\n".join(_chat_lines(3) + [json.dumps(long_chat)]) + "\n")
    drop, truncate = run_entries([
        ("finetune", QUICK + ["--data-path", data, "--overlong", "drop"], tmp_path),
        ("finetune", QUICK + ["--data-path", data, "--overlong", "truncate"], tmp_path),
    ])
    for proc in (drop, truncate):
        check_ok(proc)
        assert "iter 2/2" in proc.stdout, describe(proc)
    assert "3 samples; longer than 128 tokens: truncated 0, dropped 1" in drop.stdout, describe(drop)
    assert "4 samples; longer than 128 tokens: truncated 1, dropped 0" in truncate.stdout, describe(truncate)


def test_tokenizer_larger_than_model_vocab(tmp_path):
    from tokenizers import Tokenizer

    tok_dir = tmp_path / "big_tokenizer"
    shutil.copytree(TINY_TOKENIZER_DIR, tok_dir)
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    tok.add_tokens([f"extra_token_{i}" for i in range(100)])
    tok.save(str(tok_dir / "tokenizer.json"))
    proc = run_entry("finetune", ["--tokenizer", tok_dir, "--preset", "tiny"], tmp_path)
    assert_user_error(proc, "--tokenizer", "612", "vocab_size 512", workdir=tmp_path)


def test_load_checkpoint_of_another_model_names_the_field(tmp_path):
    """A checkpoint of the tiny preset (saved without MTP) loaded into a model with hidden_size 32, and resumed
    with --mtp: each a one-line error saying what differs. (Without --mtp the resume follows the checkpoint and
    trains without MTP: tests/test_conversion_tools.py::test_finetune_follows_the_checkpoints_mtp.)"""
    from megatron_glm5 import GLM5Config

    saved, savedir = _first_run("test_load_checkpoint_of_another_model_names_the_field", tmp_path / "saved")
    check_ok(saved)
    checkpoint = savedir / "ckpt"
    hf = GLM5Config.from_preset("tiny").to_hf()
    hf["hidden_size"] = 32
    config_dir = tmp_path / "narrow"
    config_dir.mkdir()
    _write(config_dir / "config.json", json.dumps(hf))
    work = tmp_path / "work"
    work.mkdir()
    narrow, with_mtp = run_entries([
        ("finetune", ["--hf-config", config_dir, "--load", checkpoint, "--save", "S1"], work),
        ("finetune", ["--preset", "tiny", "--load", checkpoint, "--save", "S2", "--mtp"], work),
    ])
    assert_user_error(narrow, "--load", "hidden_size=64", "32", workdir=work)
    assert_user_error(with_mtp, "--mtp", "holds no MTP weights", "--finetune", workdir=work)


def test_global_batch_not_divisible_is_a_flag_error(tmp_path):
    proc = run_entry("finetune", ["--global-batch-size", "3", "--micro-batch-size", "2"], tmp_path)
    assert_user_error(proc, "--global-batch-size 3", "--micro-batch-size 2", workdir=tmp_path)


# ---------------------------------------------------------------------------- 9. resume: model, batch, optimizer


def test_resume_switching_distributed_optimizer_continues(resume_runs, tmp_path):
    """--use-distributed-optimizer switched at a resume, both ways: the optimizer state converts (Adam's moments,
    step, main parameters) and training continues as the uninterrupted run did: the first resumed step's loss
    bitwise (the weights), the later ones within 1e-6 (the two optimizers sum the gradient norm, hence the
    clipping factor, in another order; an optimizer starting afresh differs by far more)."""
    plain, dist = resume_runs["finetune"].root, resume_runs["pretrain"].root  # pretrain ran distributed
    to_dist, to_plain = run_entries([
        ("finetune", RESUME_FLAGS + ["--load", plain / "B", "--save", "CD", "--use-distributed-optimizer"], tmp_path),
        ("pretrain", RESUME_FLAGS + ["--load", dist / "B", "--save", "CP"], tmp_path)])
    for proc, saved, now, root, out in ((to_dist, "plain", "distributed", plain, "CD"),
                                        (to_plain, "distributed", "plain", dist, "CP")):
        check_ok(proc)
        assert f"written by the {saved} optimizer, this run uses the {now} one" in proc.stdout, describe(proc)
        a, c = read_metrics(root / "A" / "tensorboard"), read_metrics(tmp_path / out / "tensorboard")
        sa, sc = series(a, "lm-loss"), series(c, "lm-loss")
        assert sorted(sc) == list(range(7, 13)), describe(proc)
        assert sc[7] == sa[7], (out, sa, sc)
        assert all(sc[i] == pytest.approx(sa[i], rel=1e-6) for i in range(8, 13)), (out, sa, sc)
        ga, gc = series(a, "grad-norm"), series(c, "grad-norm")
        assert all(gc[i] == pytest.approx(ga[i], rel=1e-6) for i in range(7, 13)), (out, ga, gc)
        assert series(c, "learning-rate") == {i: series(a, "learning-rate")[i] for i in range(7, 13)}


BF16_SWITCH_SCRIPT = """
import tempfile, torch
from megatron.core import parallel_state as ps
from megatron_glm5 import platform
from megatron_glm5.mcore_patches import registry as mcore_patches
from megatron_glm5.mcore_patches.record import Phase
from megatron_glm5.arguments import parse_args, validate_args
from megatron_glm5.training import checkpointing, loop
from megatron_glm5.training.optim import build_optimizer, build_scheduler

mcore_patches.apply_phase(Phase.TRAINING)

def build(seed, save, dist):
    flags = ["--preset", "tiny", "--attn", "torch", "--seq-length", "32", "--micro-batch-size", "1",
             "--global-batch-size", "1", "--seed", str(seed), "--no-mtp", "--save", save, "--lr-warmup-iters", "0"]
    args = parse_args(flags + (["--use-distributed-optimizer"] if dist else []), mode="pretrain")
    validate_args(args, world_size=1)
    args.bf16, args.params_dtype = True, torch.bfloat16  # the flags refuse bf16 without a GPU
    torch.manual_seed(seed)
    platform.initialize_model_parallel(seed=seed)
    model = loop.wrap_ddp(args, loop.build_model_chunks(args))
    optimizer = build_optimizer(args, model)
    return args, model, optimizer, build_scheduler(args, optimizer)

def step(model, opt, seed):  # one update from fixed pseudo-random gradients
    torch.manual_seed(seed)
    for m in model:
        m.zero_grad_buffer()
    opt.zero_grad()
    for p in model[0].module.parameters():
        p.main_grad.copy_(torch.randn(p.shape) * 1e-2)
    opt.step()

def weights(model):
    return {k: v.detach().float().clone() for k, v in model[0].module.state_dict().items()
            if torch.is_tensor(v) and v.is_floating_point()}

for src_dist in (False, True):
    tmp = tempfile.mkdtemp()
    args, model, opt, sched = build(1, tmp, src_dist)
    step(model, opt, 11)
    step(model, opt, 12)
    checkpointing.save_checkpoint(tmp, 2, [m.module for m in model], opt, sched, args, {"consumed_train": 0})
    step(model, opt, 13)
    ref = weights(model)
    ps.destroy_model_parallel()
    for fresh in (False, True):  # fresh: without the optimizer state (the control: it must differ)
        args, model, opt, sched = build(2, tmp, not src_dist)
        args.load, args.no_load_optim = tmp, fresh
        checkpointing.load_checkpoint(tmp, [m.module for m in model], opt, sched, args)
        step(model, opt, 13)
        got = weights(model)
        print("RESULT", src_dist, fresh, sum(not torch.equal(ref[k], got[k]) for k in ref), len(ref))
        ps.destroy_model_parallel()
"""


def test_bf16_optimizer_state_converts_between_plain_and_distributed(tmp_path):
    """bf16 (the GPU path; built directly, the flags refuse bf16 on CPU): a checkpoint of megatron-core's plain
    bf16 optimizer (fp32 main copies as optimizer.state.fp32_param) loads into the distributed optimizer (main
    copies as optimizer.state.param) and back; the next update gives bitwise the weights of the uninterrupted
    run, which loading without the optimizer state does not."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", BF16_SWITCH_SCRIPT], cwd=tmp_path, capture_output=True, text=True,
                       timeout=600, env={"PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
                                         "TORCHDYNAMO_DISABLE": "1"})
    results = [line.split()[1:] for line in r.stdout.splitlines() if line.startswith("RESULT")]
    assert r.returncode == 0 and len(results) == 4, r.stderr[-3000:]
    for src_dist, fresh, differ, total in results:
        what = ("distributed -> plain" if src_dist == "True" else "plain -> distributed", fresh)
        assert int(total) > 50, what
        assert int(differ) == 0 if fresh == "False" else int(differ) > 10, (what, differ, total)


def _hf_config(tmp_path, name: str, **changes) -> Path:
    from megatron_glm5 import GLM5Config

    hf = GLM5Config.from_preset("tiny").to_hf()
    for key, value in changes.items():
        if key == "rope_theta":
            hf["rope_parameters"]["rope_theta"] = value
        else:
            hf[key] = value
    path = tmp_path / name
    path.mkdir()
    _write(path / "config.json", json.dumps(hf))
    return path


def test_resume_compares_every_model_field_and_load_alone_takes_the_checkpoints_model(resume_runs, tmp_path):
    """Every field that changes what the model computes is compared at a resume (not only the weight shapes); a
    fine-tune from the weights with another rope_theta is allowed with a warning; --load DIR alone builds the
    model the checkpoint holds, and --preset contradicting it is one line naming both values."""
    ckpt = resume_runs["finetune"].root / "B"  # the tiny preset (rope_theta 10000), at iteration 6
    rope = _hf_config(tmp_path, "rope", rope_theta=8e6)
    routing = _hf_config(tmp_path, "routing", n_group=2, num_experts_per_tok=3, routed_scaling_factor=1.0,
                         rms_norm_eps=1e-3)
    quick = ["--train-iters", "1", "--eval-iters", "0", "--log-interval", "1"]
    other_rope, other_routing, finetune_rope, saved_rope = run_entries([
        ("finetune", ["--hf-config", rope, "--load", ckpt, "--no-save", "--train-iters", "8"], tmp_path),
        ("finetune", ["--hf-config", routing, "--load", ckpt, "--no-save", "--train-iters", "8"], tmp_path),
        ("finetune", quick + ["--hf-config", rope, "--load", ckpt, "--finetune", "--no-save"], tmp_path),
        ("finetune", quick + ["--hf-config", rope, "--save", "R"], tmp_path)])
    assert_user_error(other_rope, f"--load {ckpt}", "checkpoint has rope_theta=10000.0 but the model "
                      f"(--hf-config {rope}) has 8000000.0", "--finetune")
    message = assert_user_error(other_routing, f"--load {ckpt}", "(--hf-config ")
    for field in ("n_group", "num_experts_per_tok", "rms_norm_eps", "routed_scaling_factor"):
        assert field in message, (field, message)
    check_ok(finetune_rope)
    assert "fine-tuning the checkpoint's weights as another model (rope_theta: 10000.0 -> 8000000.0" in \
        finetune_rope.stdout, describe(finetune_rope)
    check_ok(saved_rope)

    alone, contradicted = run_entries([
        ("finetune", quick + ["--load", "R", "--finetune", "--save", "R2"], tmp_path),
        ("finetune", ["--load", "R", "--preset", "tiny", "--no-save", "--train-iters", "2"], tmp_path)])
    check_ok(alone)
    assert "model: the one checkpoint R holds" in alone.stdout, describe(alone)
    assert json.loads((tmp_path / "R2" / "run.json").read_text())["model"]["rope_theta"] == 8e6
    assert_user_error(contradicted, "--load R/iter_0000001: checkpoint has rope_theta=8000000.0 but the model "
                      "(--preset tiny) has 10000.0")


# ------------------------------------------------------------------------------------------------ 1. the default


@pytest.mark.slow
def test_default_finetune_run_trains_and_saves(tmp_path):
    """`python finetune_glm5.py` with no flags: 300 iterations, checkpoint + latest pointer + TensorBoard events,
    validation loss at the last evaluation at least 30% below iteration 0's."""
    proc, workdir = _first_run("test_default_finetune_run_trains_and_saves", tmp_path)
    check_ok(proc)
    save = only_run_dir(workdir / "runs" / "finetune_tiny")  # each run without --save gets its own directory
    assert (save / "iter_0000300" / "metadata.json").is_file(), describe(proc)
    assert latest_iteration(save) == 300
    assert not list(save.glob("*.partial"))
    assert list((save / "tensorboard").glob("events.out.tfevents.*"))
    valid = event_scalars(save / "tensorboard").Scalars("validation/lm-loss")
    assert valid[0].step == 0 and valid[-1].step == 300, [(e.step, e.value) for e in valid]
    assert valid[-1].value <= 0.7 * valid[0].value, [(e.step, e.value) for e in valid]
