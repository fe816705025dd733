"""Parallel conversion (--workers N; megatron_glm5/conversion/parallel.py, tensor_jobs.py).

- 1, 2 and 3 workers write byte-identical outputs in both directions (every file's sha256, .metadata and the
  safetensors index included), equal to the sequential DCP writer's data file, and the round trip is bitwise;
- a worker that fails (a NaN in the HF input; a truncated torch_dist data file) fails the conversion with its one
  line, leaves neither target nor .partial, and no worker process behind;
- --workers 0 is refused, --workers above the number of tensors is clamped (same bytes);
- under torchrun (2 ranks x 2 workers) both directions write the same bytes as one process.
"""
from __future__ import annotations

import hashlib
import multiprocessing
import os
import shutil
import subprocess
import sys

from dataclasses import dataclass

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHUNK = 64 * 1024  # many chunks / jobs from the tiny model


def hashes(directory) -> dict:
    out = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from test_conversion_tools import make_hf_dir

    d = tmp_path_factory.mktemp("parallel") / "hf"
    d.mkdir()
    return make_hf_dir("tiny", d, bf16=True, sharded=2)[0]


def _import(hf, out, workers, **kw):
    from megatron_glm5.conversion.convert import convert_hf_to_megatron
    return convert_hf_to_megatron(str(hf), str(out), progress=False, workers=workers, max_chunk_bytes=CHUNK, **kw)


def _export(ckpt, out, workers, **kw):
    from megatron_glm5.conversion.convert import convert_megatron_to_hf
    return convert_megatron_to_hf(str(ckpt), str(out), progress=False, workers=workers, max_shard_size="300KB",
                                  **kw)


def test_split_by_bytes_is_contiguous_balanced_and_deterministic():
    from megatron_glm5.conversion.parallel import split_by_bytes

    assert split_by_bytes([10, 10, 10, 10], 2) == [(0, 2), (2, 4)]
    assert split_by_bytes([100, 1, 1, 1, 1], 2) == [(0, 1), (1, 5)]
    assert split_by_bytes([0, 5, 5, 0], 2) == [(0, 2), (2, 4)]  # zero-byte objects go with their neighbours
    assert split_by_bytes([7], 3) == [(0, 0), (0, 1), (1, 1)]  # the part holding its middle byte
    sizes = [(i * 37) % 11 + 1 for i in range(50)]
    ranges = split_by_bytes(sizes, 4)
    assert ranges[0][0] == 0 and ranges[-1][1] == 50 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    shares = [sum(sizes[a:b]) for a, b in ranges]
    assert max(shares) - min(shares) <= 2 * max(sizes)


def test_one_two_three_workers_write_the_same_bytes(hf_dir, tmp_path, monkeypatch):
    from test_conversion_tools import assert_bitwise_same, read_hf

    from megatron_glm5.conversion import convert
    from megatron_glm5.conversion.torch_dist_stream import StreamingFileSystemWriter

    out = tmp_path / "mc"  # the same target path each time: it is recorded in .metadata
    mc = {}
    for w in (1, 2, 3):
        summary = _import(hf_dir, out, w)
        assert summary["workers"] == w and len(summary["worker_peak_rss_bytes"]) == w
        assert all(p > 0 for p in summary["worker_peak_rss_bytes"])
        mc[w] = hashes(out)
        if w < 3:
            shutil.rmtree(out)
    assert set(mc[1]) == {".metadata", "__0_0.distcp", "metadata.json", "config.json", "generation_config.json"}
    assert mc[1] == mc[2] == mc[3]
    hf = {}
    for w in (1, 2, 3):
        summary = _export(out, tmp_path / "hf", w)
        assert summary["shards"] >= 4 and summary["workers"] == w
        hf[w] = hashes(tmp_path / "hf")
        if w == 1:
            assert_bitwise_same(read_hf(tmp_path / "hf"), read_hf(hf_dir))
        shutil.rmtree(tmp_path / "hf")
    assert "model.safetensors.index.json" in hf[1] and hf[1] == hf[2] == hf[3]

    # the DCP data file is byte for byte what the sequential writer (one item after another) writes
    class Sequential(StreamingFileSystemWriter):
        def __init__(self, path, runner, final_path=None, on_item=None):
            super().__init__(path, final_path=final_path, on_item=on_item)

    monkeypatch.setattr(convert, "ParallelDcpWriter", Sequential)
    _import(hf_dir, tmp_path / "seq", 1)
    assert hashes(tmp_path / "seq")["__0_0.distcp"] == mc[1]["__0_0.distcp"]


def _one_line_error(capsys):
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1, err
    return err[0]


def test_a_failing_worker_fails_the_conversion_and_leaves_nothing(hf_dir, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    from megatron_glm5.conversion.cli import hf_to_megatron_main, megatron_to_hf_main

    bad = tmp_path / "bad"
    shutil.copytree(hf_dir, bad)
    shard = sorted(p for p in os.listdir(bad) if p.endswith(".safetensors"))[-1]
    state = load_file(str(bad / shard))
    name = sorted(k for k in state if k.endswith("down_proj.weight"))[-1]
    state[name][1, 2] = float("nan")
    save_file(state, str(bad / shard), metadata={"format": "pt"})
    out = tmp_path / "out"
    assert hf_to_megatron_main(["--hf-dir", str(bad), "--save", str(out), "--no-progress", "--workers", "3",
                                "--max-chunk-size", "64KiB"]) == 2
    line = _one_line_error(capsys)
    assert name in line and "non-finite" in line and "--allow-nonfinite" in line
    assert not out.exists() and not (tmp_path / "out.partial").exists()
    assert multiprocessing.active_children() == []

    # export: the data file cut short, found by the worker that reads its last tensors
    ckpt = tmp_path / "mc"
    _import(hf_dir, ckpt, 1)
    data = ckpt / "__0_0.distcp"
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) - 4096)
    assert megatron_to_hf_main(["--load", str(ckpt), "--save", str(tmp_path / "hf"), "--no-progress",
                                "--workers", "3", "--max-shard-size", "300KB"]) == 2
    line = _one_line_error(capsys)
    assert "__0_0.distcp" in line and "short" in line
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.partial").exists()
    assert multiprocessing.active_children() == []


@dataclass
class WriteAt:
    """A job for the runner alone: writes ``text`` at ``offset`` of ``path``."""
    path: str
    offset: int
    text: bytes

    @property
    def nbytes(self):
        return len(self.text)

    def run(self, ctx):
        f = ctx.file(self.path)
        f.seek(self.offset)
        f.write(self.text)
        ctx.progress(len(self.text))


def test_workers_flag_is_checked_and_clamped(hf_dir, tmp_path, capsys, caplog):
    from megatron_glm5.conversion.cli import hf_to_megatron_main
    from megatron_glm5.conversion.parallel import Runner

    assert hf_to_megatron_main(["--hf-dir", str(hf_dir), "--save", str(tmp_path / "x"), "--workers", "0"]) == 2
    assert "--workers 0: must be an integer >= 1" in _one_line_error(capsys)
    assert not (tmp_path / "x").exists()
    target = tmp_path / "f"
    target.write_bytes(b"." * 6)
    caplog.set_level("INFO", logger="megatron_glm5.conversion")
    runner, counted = Runner(5), []
    runner.run([WriteAt(str(target), 0, b"abc"), WriteAt(str(target), 3, b"def")], on_bytes=counted.append)
    assert target.read_bytes() == b"abcdef" and sum(counted) == 6
    assert runner.used_workers == 2 and len(runner.worker_peak_rss) == 2
    assert any("--workers 5: only 2 tensor jobs, using 2 workers" in r.getMessage() for r in caplog.records)


_RANKS_SCRIPT = r"""
import os, sys
sys.path.insert(0, {root!r})
from megatron_glm5.conversion.cli import hf_to_megatron_main, megatron_to_hf_main
if __name__ == "__main__":  # the workers' fork server imports this file again
    assert hf_to_megatron_main(["--hf-dir", {hf!r}, "--save", {mc!r}, "--workers", "2", "--max-chunk-size", "64KiB",
                                "--no-progress"]) == 0
    assert megatron_to_hf_main(["--load", {mc!r}, "--save", {out!r}, "--workers", "2", "--max-shard-size", "300KB",
                                "--no-progress"]) == 0
"""


@pytest.mark.slow
def test_torchrun_ranks_write_the_same_bytes(hf_dir, tmp_path):
    mc, out = tmp_path / "mc", tmp_path / "hf"
    _import(hf_dir, mc, 1)
    _export(mc, out, 1)
    ref_mc, ref_hf = hashes(mc), hashes(out)
    shutil.rmtree(mc)
    shutil.rmtree(out)
    script = tmp_path / "ranks.py"
    script.write_text(_RANKS_SCRIPT.format(root=ROOT, hf=str(hf_dir), mc=str(mc), out=str(out)))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert hashes(mc) == ref_mc and hashes(out) == ref_hf
