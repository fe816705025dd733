"""What a run prints: our own lines, not third-party noise (megatron_glm5/quiet.py); --verbose shows it all; a flag
error under torchrun is one line, and torchrun's failure summary names it (megatron_glm5/torchrun_report.py)."""
from __future__ import annotations

import os
import subprocess
import sys

from training_helpers import REPO, check_ok, describe, entry_env, run_entry

NOISE = ("Transformer Engine and Apex are not installed", "full scope is deprecated",
         "torch.distributed is disabled, unavailable or uninitialized", "The argument order of load has been changed",
         "MimoModelConfig is experimental", "warnings.warn(")
BACKEND_LINES = ("attention backend:", "MoE token permute/unpermute")
TINY = ["--eval-iters", "0", "--seq-length", "64", "--log-interval", "1"]


def _noise(text: str):
    return [n for n in NOISE if n in text]


def _tool(name, *args, cwd):
    return subprocess.run([sys.executable, str(REPO / "tools" / name), *map(str, args)], cwd=str(cwd),
                          env=entry_env(), capture_output=True, text=True, timeout=300)


def test_runs_and_conversions_print_no_third_party_noise_and_verbose_shows_it(tmp_path):
    save = tmp_path / "run"
    first = check_ok(run_entry("finetune", ["--train-iters", "1", "--save", save, "--verbose", *TINY], tmp_path))
    assert "Transformer Engine and Apex are not installed" in first.stderr, describe(first)  # --verbose: all of it
    resumed = check_ok(run_entry("finetune", ["--train-iters", "2", "--load", save, "--save", save, *TINY], tmp_path))
    assert "resumed from" in resumed.stdout, describe(resumed)  # a load: torch.distributed.checkpoint's warnings
    assert _noise(resumed.stdout + resumed.stderr) == [], describe(resumed)
    assert "Warning" not in resumed.stderr, describe(resumed)
    # the conversion tools: no noise either, and not the trainer's backend lines (they build a model, never run it)
    hf = tmp_path / "hf"
    out = _tool("convert_megatron_to_hf.py", "--load", save, "--save", hf, "--no-progress", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    back = _tool("convert_hf_to_megatron.py", "--hf-dir", hf, "--save", tmp_path / "back", "--no-progress",
                 cwd=tmp_path)
    assert back.returncode == 0, back.stderr[-3000:]
    for proc in (out, back):
        text = proc.stdout + proc.stderr
        assert _noise(text) == [] and [b for b in BACKEND_LINES if b in text] == [], text[-3000:]


def test_flag_error_under_torchrun_is_one_line_and_named_in_torchruns_summary(tmp_path):
    env = entry_env()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(REPO / "finetune_glm5.py"), "--ep", "3", "--train-iters", "2"], cwd=str(tmp_path),
                          env=env, capture_output=True, text=True, timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text
    ours = [line for line in text.splitlines() if line.startswith("error:")]
    message = "error: world size 2 is not divisible by --etp 1 x --ep 3 x --pp 1 = 3 (the expert layout)"
    assert ours == [message], text  # rank 0 alone prints it
    assert _noise(text) == [], text
    # torchrun's own summary (printed by torchrun, which a rank cannot silence) shows the line, not a pointer
    # to "enable traceback"
    root = text[text.index("Root Cause"):]
    assert f"traceback : {message}" in root, text
    assert "To enable traceback see" not in text, text
    assert os.path.exists(tmp_path) and not any(tmp_path.iterdir()), list(tmp_path.iterdir())  # nothing written
