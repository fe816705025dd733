"""The model-level benchmark script runs end to end on CPU (a tiny proxy, both implementations); its numbers on
the GPU are in docs/performance.md."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from megatron_glm5.config import GLM5Config

REPO = Path(__file__).resolve().parents[1]


def test_proxy_step_benchmark_runs_both_implementations(tmp_path):
    out = tmp_path / "proxy.json"
    cmd = [sys.executable, str(REPO / "benchmarks/proxy_step.py"), "--preset", "tiny", "--layers", "2", "--dense", "1",
           "--seq", "64", "--steps", "2", "--warmup", "1", "--attn", "torch", "--device", "cpu", "--json", str(out), "--profile", "5"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "speed-up" in r.stdout
    assert r.stdout.count("== profile:") == 2 and "aten::" in r.stdout  # the --profile tables of both
    res = {x["impl"]: x for x in json.loads(out.read_text())["results"]}
    assert set(res) == {"ours", "transformers"}
    ln_vocab = math.log(GLM5Config.from_preset("tiny").vocab_size)
    for impl, x in res.items():
        assert x["ms_per_step"] > 0 and x["tokens_per_s"] > 0
        # random initialisation predicts nearly uniformly: the first loss is about ln(vocab) for both
        assert abs(x["losses"][0] - ln_vocab) < 0.1 * ln_vocab, (impl, x["losses"], ln_vocab)


def test_kernel_sweep_keeps_the_fastest_configuration_and_records_failures(monkeypatch):
    """benchmarks/kernels.py's sweep helper (the timing itself needs a GPU: replaced by a fake clock here)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import kernels

    def fake_timed(fn, refill, reps):
        return fn()

    def run(cfg):
        if cfg["BLOCK_N"] == 128:
            raise RuntimeError("out of resource: shared memory, Required: 300000\nsecond line")
        return {16: 3.0, 32: 1.5, 64: 2.0}[cfg["BLOCK_N"]]

    monkeypatch.setattr(kernels, "timed", fake_timed)
    logs = []
    configs = [dict(BLOCK_N=n) for n in (16, 32, 128, 64)]
    rows, best = kernels._try_configs("fwd", configs, run, None, 3, logs.append, flop=3e12)
    assert best == dict(BLOCK_N=32)
    assert rows[1]["tflops"] == 3e12 / 1.5 / 1e9 and rows[2]["error"].startswith("out of resource")
    assert any("failed: out of resource" in line for line in logs)
    assert kernels._try_configs("fwd", configs[2:3], run, None, 3, logs.append) == ([rows[2]], None)


def test_tilelang_examples_folder_is_checked_before_use(tmp_path):
    """--tilelang-examples DIR must be TileLang's examples/deepseek_v32 folder: anything else stops with the flag
    and the missing files named (the kernels themselves need a GPU and tilelang)."""
    import pytest

    sys.path.insert(0, str(REPO / "benchmarks"))
    import peer_tilelang

    (tmp_path / "sparse_mla_fwd.py").write_text("")
    with pytest.raises(SystemExit) as e:
        peer_tilelang.load_examples(str(tmp_path))
    assert "--tilelang-examples" in str(e.value) and "sparse_mla_bwd.py" in str(e.value)
    assert "sparse_mla_fwd.py" not in str(e.value).split("missing")[1]
