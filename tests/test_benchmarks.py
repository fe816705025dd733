"""The model-level benchmark script runs end to end on CPU (a tiny proxy, both implementations); its numbers on
the GPU are in docs/performance.md."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_glm5.config import GLM5Config

REPO = Path(__file__).resolve().parents[1]


def test_proxy_step_benchmark_runs_both_implementations(tmp_path):
    out = tmp_path / "proxy.json"
    cmd = [sys.executable, str(REPO / "benchmarks/proxy_step.py"), "--preset", "tiny", "--layers", "2", "--dense", "1",
           "--seq", "64", "--steps", "2", "--warmup", "1", "--attn", "torch", "--device", "cpu", "--json", str(out), "--profile", "5",
           "--manual-gc", "--trace", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "speed-up" in r.stdout
    assert r.stdout.count("== profile:") == 2 and "aten::" in r.stdout  # the --profile tables of both
    res = {x["impl"]: x for x in json.loads(out.read_text())["results"]}
    assert set(res) == {"ours", "transformers"}
    assert (tmp_path / "trace_ours.json.gz").stat().st_size > 0 and (tmp_path / "trace_transformers.json.gz").exists()
    ln_vocab = math.log(GLM5Config.from_preset("tiny").vocab_size)
    for impl, x in res.items():
        assert x["ms_per_step"] > 0 and x["tokens_per_s"] > 0
        # random initialisation predicts nearly uniformly: the first loss is about ln(vocab) for both
        assert abs(x["losses"][0] - ln_vocab) < 0.1 * ln_vocab, (impl, x["losses"], ln_vocab)


def test_kernel_sweep_keeps_the_fastest_configuration_and_records_failures(monkeypatch):
    """benchmarks/dsa_kernels.py's sweep helper (the timing itself needs a GPU: replaced by a fake clock here)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import dsa_kernels as kernels

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


def test_trace_gaps_finds_the_idle_gpu_time_and_who_issued_late(tmp_path):
    """A hand-made trace: kernels A [0, 10), B [15, 20) launched at 5 (early: the GPU was busy), C [30, 40)
    launched at 25 inside host op "slow_op" (late: the GPU drained at 20), so 5 + 10 us of gaps, 10 late."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import trace_gaps

    def k(name, ts, dur, corr):
        return dict(ph="X", cat="kernel", name=name, ts=ts, dur=dur, args=dict(correlation=corr))

    def launch(ts, corr):
        return dict(ph="X", cat="cuda_runtime", name="cudaLaunchKernel", ts=ts, dur=1, args=dict(correlation=corr))

    events = [k("A", 0, 10, 1), k("B", 15, 5, 2), k("C", 30, 10, 3), launch(-1, 1), launch(5, 2), launch(25, 3),
              dict(ph="X", cat="cpu_op", name="outer", ts=-2, dur=40), dict(ph="X", cat="cpu_op", name="slow_op",
                                                                              ts=22, dur=5)]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    import io
    res = trace_gaps.report(str(path), 5, 1.0, out=io.StringIO())
    assert res["gap_ms"] == 0.015 and res["late_gap_ms"] == 0.010 and res["span_ms"] == 0.040
    assert res["late_by_op_ms"] == {"slow_op": 0.010}


def test_no_benchmark_module_shadows_an_installed_package():
    """`python benchmarks/X.py` puts benchmarks/ first on the module path, so a benchmark module named like an
    installed package replaces it for every importer (benchmarks/kernels.py did so for the `kernels` package that
    transformers 5.25 imports, and the proxy step failed to build transformers' model)."""
    import importlib.metadata

    installed = set(importlib.metadata.packages_distributions())
    stems = {p.stem for p in (REPO / "benchmarks").glob("*.py")}
    assert not stems & installed, sorted(stems & installed)


def test_profile_categories_of_our_kernel_names():
    """The step profile's categories (benchmarks/proxy_step.py): first match wins, so a kernel whose name ends like
    the sparse kernels' (_bwd_kernel) but is elementwise work is counted as such."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from proxy_step import kernel_category

    assert kernel_category("_swiglu_bwd_kernel") == kernel_category("_swiglu_fwd_kernel") == "elementwise"
    assert kernel_category("_bwd_kernel") == kernel_category("sparse_mla_pds_ws_kernel_kernel") == "sparse attention"
    assert kernel_category("_indexer_kl_kernel") == kernel_category("_selected_lse_kernel") == "KL"
    assert kernel_category("_restore_zeros_kernel") == "copies"  # the kept-zero buffer's zeroing, as the memsets
    assert kernel_category("triton_poi_fused_add_cat_0") == "elementwise"
    assert kernel_category("void at::native::vectorized_elementwise_kernel<8, FillFunctor>") == "copies"  # memsets
    assert kernel_category("nvjet_sm90_tst_256x128") == "GEMMs"


def test_proxy_step_config_overrides():
    """--bwd-config / --kl-config KEY=VALUE: Python literals, else strings; unknown keys and missing '=' stop with
    the flag named."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from proxy_step import config_overrides

    cfg = dict(ZEROS="memset", ZERO_AHEAD=True, DENSE_ROWS=None)
    assert config_overrides(["ZEROS=restore", "ZERO_AHEAD=False", "DENSE_ROWS=512"], cfg, "--bwd-config") == dict(
        ZEROS="restore", ZERO_AHEAD=False, DENSE_ROWS=512)
    for bad in ("ZEROS", "NOPE=1"):
        with pytest.raises(SystemExit, match="--bwd-config: expected KEY=VALUE"):
            config_overrides([bad], cfg, "--bwd-config")


def test_l2_persistence_benchmark_parses_its_arguments():
    """benchmarks/l2_persistence.py (GPU only: the CUDA runtime's access-policy window) imports and answers --help on
    CPU; its figures are in docs/performance.md."""
    r = subprocess.run([sys.executable, str(REPO / "benchmarks/l2_persistence.py"), "--help"], capture_output=True,
                       text=True, timeout=120, cwd=REPO / "benchmarks")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--seqs" in r.stdout and "L2" in r.stdout


def test_interleaved_rounds_time_every_configuration_once_per_round(monkeypatch):
    """dsa_kernels.interleaved_ms: round by round, each configuration once in the given order (a fake clock that
    drifts by +1 ms per call stands in for the GPU), and the median of an odd / even number of rounds."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import dsa_kernels as kernels

    calls = []

    def fake_timed(fn, refill, reps):
        calls.append(fn())
        return float(len(calls))  # a clock that drifts: later calls read slower

    monkeypatch.setattr(kernels, "timed", fake_timed)
    got = kernels.interleaved_ms({"a": lambda: "a", "b": lambda: "b", "c": lambda: "c"}, None, 5, 3)
    assert calls == ["a", "b", "c"] * 3
    assert got == {"a": [1.0, 4.0, 7.0], "b": [2.0, 5.0, 8.0], "c": [3.0, 6.0, 9.0]}
    assert kernels.median(got["b"]) == 5.0 and kernels.median([4.0, 1.0, 3.0, 2.0]) == 2.5
    assert kernels.interleaved_ms({"a": lambda: "a"}, None, 5, 1) == {"a": [10.0]}


def test_forward_rounds_time_the_default_first_and_each_variant_once():
    """dsa_kernels.fwd_round_configs (the --fwd-only / --bwd-only forward rows): our backend's forward first, then
    whole blocks, the L2 hints, the asynchronous wgmma, persistent (also async, bounded), bounded and the staggered
    schedule, each a complete configuration (its own builder) under a label of its own."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import dsa_kernels as kernels
    from megatron_glm5.ops import tilelang_sparse_mla_staggered as stg
    from megatron_glm5.ops import tilelang_sparse_mla_ws as ws

    configs = kernels.fwd_round_configs()
    labels = [label for label, _ in configs]
    assert len(set(labels)) == len(labels) == 9
    assert configs[0][1] is ws.WS_CONFIG
    assert [c for _, c in configs[1:]] == [ws.WS_WHOLE_BLOCKS_CONFIG, ws.WS_L2_HINTS_CONFIG, ws.WS_ASYNC_CONFIG,
                                           ws.WS_PERSISTENT_CONFIG, ws.WS_PERSISTENT_ASYNC_CONFIG,
                                           ws.WS_PERSISTENT_BOUNDED_CONFIG,
                                           ws.WS_BOUNDED_CONFIG, stg.WS_STAGGERED_CONFIG]
    assert all("builder" in c for _, c in configs)


def test_ncu_target_names_the_forward_rounds_configurations_and_checks_its_flags(capsys):
    """benchmarks/ncu_target.py (one call for Nsight Compute; the call itself needs a GPU): --config names the
    configurations of dsa_kernels.fwd_round_configs (one list), flags of the other op are refused, and without a
    GPU it says so."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import dsa_kernels as kernels
    import ncu_target

    names = ncu_target.forward_configs()
    assert list(names) == ["default", "whole blocks", "L2 hints", "async wgmma", "persistent", "persistent async",
                           "persistent bounded", "bounded", "staggered"]
    assert list(names.values()) == [c for _, c in kernels.fwd_round_configs()]
    args = ncu_target.parse(["--op", "fwd", "--config", "staggered", "--unused"])
    assert (args.seq, args.config, args.unused) == (32768, "staggered", True)
    assert ncu_target.parse(["--op", "bwd", "--seq", "4096", "--pieces", "256"]).pieces == 256
    for bad, says in ((["--op", "fwd", "--config", "fast"], "--config 'fast': one of default, whole blocks"),
                      (["--op", "bwd", "--unused"], "--config and --unused are the forward's"),
                      (["--op", "fwd", "--config", "bounded", "--unused"], "bounded runs no step with every slot"),
                      (["--op", "fwd", "--pieces", "256"], "--pieces takes a positive number of rows"),
                      (["--op", "bwd", "--pieces", "0"], "--pieces takes a positive number of rows")):
        with pytest.raises(SystemExit):
            ncu_target.parse(bad)
        assert says in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            ncu_target.main(["--op", "fwd"])


def test_host_profile_names_the_functions_the_host_spends_its_time_in():
    """benchmarks/host_profile.py (the dense backward's host profile, dsa_kernels --profile-bwd-host): a call that
    spends its time in one helper is profiled for every call asked, and that helper heads the own-time table."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from host_profile import host_profile

    def _slow_helper_for_the_profile():
        acc = 0
        for i in range(300_000):
            acc += i * i
        return acc

    def call():
        _slow_helper_for_the_profile()
        return len(str(3))

    lines = []
    stats = host_profile(call, 3, 5, lines.append)
    assert len(lines) == 2 and "own time" in lines[0] and "time under them" in lines[1]
    own = lines[0].splitlines()
    assert own[1].split()[0] == "ncalls" and own[2].split()[0] == "3", own[:4]
    assert own[2].endswith("(_slow_helper_for_the_profile)"), own[:4]
    assert any(line.endswith("(call)") for line in lines[1].splitlines()[2:5]), lines[1]
    calls = {f[2]: v[0] for f, v in stats.stats.items()}
    assert calls["_slow_helper_for_the_profile"] == 3 and calls["call"] == 3


def test_dsa_kernels_refuses_a_host_profile_without_the_backward_profile():
    """--profile-bwd-host N needs --profile-bwd (it profiles that backward) and a positive N: refused by name before
    anything needs a GPU."""
    for flags in (["--profile-bwd-host", "10"], ["--profile-bwd", "--profile-bwd-host", "-1"]):
        r = subprocess.run([sys.executable, str(REPO / "benchmarks/dsa_kernels.py"), *flags], capture_output=True,
                           text=True, timeout=120, cwd=REPO / "benchmarks")
        assert r.returncode == 2 and "--profile-bwd-host" in r.stderr, (flags, r.stderr[-1000:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_queued_timing_leaves_out_the_hosts_issue_time():
    """cuda_timing.queued_ms times a call's GPU work with the host ahead: a call whose host side sleeps 20 ms before
    one small kernel takes 20 ms or more from an idle GPU (median_ms) and well under that queued behind busy work,
    with every run queued."""
    import time

    sys.path.insert(0, str(REPO / "benchmarks"))
    from cuda_timing import median_ms, queued_ms

    x = torch.zeros(1024, device="cuda")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def call():
        time.sleep(0.02)
        x.add_(1)

    def busy():  # about 1.1 TFLOP each: 45-60 ms on an H100 / H200, longer than the call's 20 ms on the host
        for _ in range(40):
            a @ a

    idle = median_ms(call, 3, warmup=1)
    gpu, host, late = queued_ms(call, busy, 3, warmup=1)
    assert idle >= 19.0 and host >= 19.0, (idle, host)
    assert late == 0 and gpu < 2.0, (gpu, late)
