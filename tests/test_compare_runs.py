"""tools/compare_runs.py: largest relative differences of logged curves against a reference run."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run_dir(root: Path, name: str, losses: dict) -> Path:
    tb = root / name / "tensorboard"
    tb.mkdir(parents=True)
    lines = [json.dumps({"iteration": it, "lm-loss": v, "lr": 1e-5}) for it, v in losses.items()]
    (tb / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return root / name


def _compare(*args):
    return subprocess.run([sys.executable, str(REPO / "tools/compare_runs.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=60)


def test_reports_the_largest_difference_and_fails_past_the_tolerance(tmp_path):
    ref = _run_dir(tmp_path, "1gpu", {1: 10.0, 2: 8.0, 3: 6.0})
    close = _run_dir(tmp_path, "tp2", {1: 10.0, 2: 8.0 * (1 + 2e-6), 3: 6.0})
    far = _run_dir(tmp_path, "pp2", {1: 10.0, 2: 8.0, 3: 6.06})
    r = _compare(ref, close, far, "--tolerance", "1e-4", "--json", tmp_path / "t.json")
    assert r.returncode == 1
    rows = {x["run"]: x for x in json.loads((tmp_path / "t.json").read_text())["rows"]}
    assert abs(rows["tp2"]["max_rel_diff"] - 2e-6) < 1e-9 and rows["tp2"]["at_iteration"] == 2
    assert abs(rows["pp2"]["max_rel_diff"] - 0.01) < 1e-9 and rows["pp2"]["at_iteration"] == 3
    assert "FAIL pp2 lm-loss" in r.stderr and "tp2" not in r.stderr
    assert _compare(ref, close, "--tolerance", "1e-4").returncode == 0


def test_bad_inputs_name_the_file(tmp_path):
    ref = _run_dir(tmp_path, "a", {1: 1.0})
    (tmp_path / "b").mkdir()
    r = _compare(ref, tmp_path / "b")
    assert r.returncode != 0 and "no metrics.jsonl at" in r.stderr
    bad = tmp_path / "c.jsonl"
    bad.write_text('{"iteration": 1, "lm-loss": 1.0}\nnot json\n')
    r = _compare(ref, bad)
    assert r.returncode != 0 and "c.jsonl:2: not a metrics record" in r.stderr
    r = _compare(ref, ref, "--key", "grad-norm")
    assert r.returncode != 0 and "logged no 'grad-norm'" in r.stderr


def test_a_torn_last_line_is_skipped_a_torn_middle_line_is_an_error(tmp_path):
    ref = _run_dir(tmp_path, "a", {1: 10.0, 2: 8.0})
    run = _run_dir(tmp_path, "b", {1: 10.0, 2: 8.0})
    with open(run / "tensorboard" / "metrics.jsonl", "a") as f:
        f.write('{"iteration": 3, "lm-lo')  # a crash or a full disk in the middle of a record
    r = _compare(ref, run, "--tolerance", "1e-6")
    assert r.returncode == 0, r.stderr
    assert "skipping an incomplete last line" in r.stderr
    text = (run / "tensorboard" / "metrics.jsonl").read_text()
    (run / "tensorboard" / "metrics.jsonl").write_text(text + "\n" + json.dumps({"iteration": 4, "lm-loss": 1}) + "\n")
    r = _compare(ref, run)
    assert r.returncode != 0 and "metrics.jsonl:3: not a metrics record" in r.stderr
