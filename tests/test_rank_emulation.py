"""benchmarks/rank_emulation.py: the dispatcher stand-in routes exactly the requested rows per local expert and
sums them back per token; the whole script runs one pipeline stage of a tiny layout on CPU (fake process group)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[1]


def _standin(local: int, rows: int):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import rank_emulation

    groups = SimpleNamespace(ep=None, expt_tp=None, tp_ep=None)  # one rank: megatron-core reads sizes of 1
    return rank_emulation.LocalPermutationDispatcher(local, rows, config=SimpleNamespace(), pg_collection=groups)


def test_standin_routes_the_requested_rows_and_sums_them_back():
    tokens, experts, topk, hidden, local = 6, 8, 2, 5, 2
    rows = 6  # tokens x top-k x EP / E with EP 4: 6 x 2 x 4 / 8
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, 1, hidden, generator=g, requires_grad=True)
    chosen = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)])
    routing = torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, chosen, True)
    probs = torch.rand(tokens, experts, generator=g) * routing
    d = _standin(local, rows)

    xr, pr = d.token_dispatch(*d.dispatch_preprocess(x, routing, probs))
    xr, counts, pr = d.dispatch_postprocess(xr, pr)
    assert counts.tolist() == [rows] * local and d.routed_counts == [[rows] * local]
    assert xr.shape == (local * rows, hidden)
    for j in range(local * rows):  # row j: token j mod T, its (j div T)-th choice in expert order
        t, k = j % tokens, (j // tokens) % topk
        assert torch.equal(xr[j], x[t, 0])
        assert pr[j] == probs[t, sorted(chosen[t].tolist())[k]]

    y = torch.randn(local * rows, hidden, generator=g)
    out = d.combine_postprocess(d.token_combine(d.combine_preprocess(y)))
    want = torch.zeros(tokens, hidden)
    for j in range(local * rows):
        want[j % tokens] += y[j]
    assert out.shape == x.shape
    torch.testing.assert_close(out[:, 0], want)


def test_standin_with_more_rows_than_pairs_wraps_over_the_tokens():
    tokens, experts, local, rows = 4, 4, 2, 10  # 20 rows from 4 tokens x top-1
    x = torch.arange(tokens * 3, dtype=torch.float32).view(tokens, 1, 3)
    routing = torch.zeros(tokens, experts, dtype=torch.bool)
    routing[torch.arange(tokens), torch.tensor([0, 3, 1, 2])] = True
    d = _standin(local, rows)
    xr, pr = d.dispatch_preprocess(x, routing, routing.float())
    assert d.dispatch_postprocess(xr, pr)[1].tolist() == [10, 10]
    assert [int(r[0]) // 3 for r in xr] == [j % tokens for j in range(20)]
    out = d.combine_postprocess(xr)
    torch.testing.assert_close(out, x * 5)  # every token gathered 20 / 4 times


def test_script_runs_a_middle_stage_of_a_tiny_layout_on_cpu(tmp_path):
    out = tmp_path / "rank.json"
    flags = ["--preset", "tiny", "--pp", "4", "--ep", "4", "--seq-length", "64", "--micro-batch-size", "1",
             "--global-batch-size", "8", "--recompute-granularity", "full", "--recompute-method", "uniform",
             "--recompute-num-layers", "1", "--use-distributed-optimizer", "--overlap-grad-reduce",
             "--attn", "torch", "--lr", "1e-3", "--train-iters", "2"]
    cmd = [sys.executable, str(REPO / "benchmarks/rank_emulation.py"), "--world-size", "16", "--rank", "5",
           "--steps", "1", "--warmup", "1", "--json", str(out), "--"] + flags
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    # world 16 = PP 4 x DP 4: rank 5 is on stage 1 (layer 1 of 4, MoE), dense shard 1; EP 4 -> 8 / 4 local experts
    assert (res["pp_rank"], res["stage_layers"], res["moe_layers"], res["local_experts"]) == (1, [1], 1, 2)
    assert res["predicted"]["pp_rank"] == 1 and res["predicted"]["dense_shard"] == 1
    rows = 64 * 2 * 4 // 8  # tokens x top-2 x EP / E
    assert res["rows_per_local_expert"] == rows
    # 2 steps x 2 micro-batches (8 / DP 4), forward + recompute: 8 dispatches, each [rows, rows]
    assert res["routed_counts"] == [[[rows, rows]] * 8]
    steps = res["measured"]["steps"]
    assert len(steps) == 2 and all(s["update_applied"] and len(s["forward_ms"]) == 2 for s in steps)
    assert res["measured"]["step_s"] > 0 and res["predicted"]["emulated_step_s"] > 0
    assert "| step of this rank, no communication (s) |" in r.stdout

    bad = subprocess.run(cmd[:2] + ["--world-size", "16", "--rank", "16", "--"] + flags, capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1] == \
        "error: --rank 16 is outside the world of 16 ranks; use 0..15", bad.stderr[-2000:]
