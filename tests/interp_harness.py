"""Running Triton kernels under the CPU interpreter for the tests: a runner script in a fresh process with
TRITON_INTERPRET=1 (the interpreter must be on before triton is imported), and the float64 references the kernel
tests share."""
from __future__ import annotations

import os
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def run_interpreted(tmp_path_factory, name: str, runner: str, cases, timeout: int = 300):
    """``python RUNNER CASES.pt RESULTS.pt`` under TRITON_INTERPRET=1 on one thread; the results it saved.
    ``runner``: a path, or a file name in tests/."""
    d = tmp_path_factory.mktemp(name)
    torch.save(cases, d / "cases.pt")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(HERE, runner), str(d / "cases.pt"), str(d / "results.pt")],
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(d / "results.pt")


def softmax_head_sums(c):
    """sum_h softmax_j(scale * q[t, h] . kv[idx[t, j]]) over the valid selected keys, fp64, 0 elsewhere."""
    q, kv, idx = c["q"].double(), c["kv"].double(), c["indices"].long()
    ok = idx >= 0
    s = torch.einsum("thd,tkd->thk", q, kv[idx.clamp_min(0)]) * c["scale"]
    p = torch.softmax(s.masked_fill(~ok[:, None, :], float("-inf")), dim=-1).nan_to_num(0.0)  # no keys: 0
    return p.sum(1)
