"""tools/generate.py under torchrun (gloo, fp32, CPU): TP2, PP2 and EP2 decode the same tokens as one process, with
the same logits at every step, and the same --eval perplexity; the layout errors are one line.

One torchrun launch per layout (tests/generation_parallel_tool.py runs generate.py's main three times in it:
greedy, seeded sampling, --eval), the three launches at once. The references are one-process runs of the same
command lines in this process (api.load_checkpoint: the whole checkpoint in one model, not the training loader
that the parallel runs use). The prompts are ragged (a chat prompt of 2 tokens, a text of more than index_topk
16 tokens, so the indexer really selects), and --dump-logits records every step's logits on the sampling rank.
- TP2 on a converted tiny-indexshare checkpoint (indexer types F S F S): heads, vocabulary and expert shards;
- PP2 on it with --decoder-first-pipeline-num-layers 1: stage 1 starts on IndexShare layer 1, whose top-k comes
  from full layer 0 on stage 0; the last stage (rank 1) samples and prints;
- EP2 on the tiny training checkpoint of the layout tests (4 experts per rank).
"""
from __future__ import annotations

import json
import shlex
import subprocess
import time
from pathlib import Path

import pytest
import torch

from layouts_harness import TORCHRUN, _env
from generation_cli import one_line_error

REPO = Path(__file__).resolve().parents[1]
RTOL = 1e-5
LONG = "The cat sat on the mat, and then it slept for a while."
LAYOUTS = {
    "tp2": ("indexshare", ["--tp", "2"], 0),  # (checkpoint, layout flags, the rank that samples and prints)
    "pp2": ("indexshare", ["--pp", "2", "--decoder-first-pipeline-num-layers", "1"], 1),
    "ep2": ("training", ["--ep", "2"], 0),
}


@pytest.fixture(scope="module")
def checkpoints(layouts_reference, tmp_path_factory):
    from hf_tiny import make_hf_model, save_hf_model
    from megatron_glm5.conversion.convert import convert_hf_to_megatron

    root = tmp_path_factory.mktemp("generation_parallel")
    hf = save_hf_model(make_hf_model("tiny-indexshare", seed=3)[0], root / "hf")
    convert_hf_to_megatron(hf, str(root / "converted"), progress=False)
    return {"indexshare": str(root / "converted"), "training": str(layouts_reference[0])}


def _runs(ckpt: str, out: Path, eval_file: Path) -> dict:
    prompts = ["--load", ckpt, "--prompt", "Hi", "--prompt", LONG, "--max-new-tokens", "8", "--json"]
    return {"greedy": prompts + ["--chat", "--greedy", "--dump-logits", str(out / "greedy.pt")],
            "sampled": prompts + ["--seed", "11", "--temperature", "0.8", "--top-p", "0.9", "--dump-logits",
                                  str(out / "sampled.pt")],
            "eval": ["--load", ckpt, "--eval", str(eval_file)]}


def _launch(name: str, ckpt: str, layout: list, root: Path, eval_file: Path):
    out = root / name
    out.mkdir()
    runs = [f"{k}={shlex.join(v)}" for k, v in _runs(ckpt, out, eval_file).items()]
    cmd = TORCHRUN + ["--nproc-per-node", "2", str(REPO / "tests" / "generation_parallel_tool.py"), str(out), *runs,
                      "--", *layout]
    log = open(out / "log.txt", "w")
    return subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT), out


def _reference(ckpt: str, out: Path, eval_file: Path, capsys) -> dict:
    from megatron_glm5.generation import cli

    out.mkdir()
    printed = {}
    for name, argv in _runs(ckpt, out, eval_file).items():
        capsys.readouterr()
        assert cli.main(argv) == 0
        printed[name] = capsys.readouterr().out
    return printed


def _rows(text: str) -> list:
    return [json.loads(x) for x in text.splitlines() if x.startswith("{")]


def _eval(text: str) -> dict:
    return json.loads(text.split("eval ", 2)[-1])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_tp2_pp2_ep2_decode_as_one_process(checkpoints, tmp_path, capsys):
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text(json.dumps({"text": LONG}) + "\n" + json.dumps(
        {"messages": [{"role": "user", "content": "What is 3 plus 4?"}, {"role": "assistant", "content": "7."}]})
        + "\n")
    t0 = time.time()
    procs = {name: _launch(name, checkpoints[c], layout, tmp_path, eval_file) for name, (c, layout, _) in
             LAYOUTS.items()}
    refs = {c: (_reference(checkpoints[c], tmp_path / f"ref_{c}", eval_file, capsys), tmp_path / f"ref_{c}")
            for c in checkpoints}
    for name, (proc, out) in procs.items():
        if proc.wait(timeout=300):
            pytest.fail(f"{name}: torchrun exited with {proc.returncode}:\n{(out / 'log.txt').read_text()[-4000:]}")
    print(f"3 launches: {time.time() - t0:.1f} s")

    for name, (c, layout, lead) in LAYOUTS.items():
        printed, ref_dir = refs[c]
        out = procs[name][1]
        for run in ("greedy", "sampled", "eval"):
            silent = (out / f"{run}.rank{1 - lead}.out").read_text()
            assert silent == "", f"{name} {run}: rank {1 - lead} printed {silent[:200]!r}"
            text = (out / f"{run}.rank{lead}.out").read_text()
            if run == "eval":
                got, want = _eval(text), _eval(printed[run])
                assert (got["records"], got["tokens"]) == (want["records"], want["tokens"])
                assert got["nll"] == pytest.approx(want["nll"], rel=1e-6), name
                continue
            got, want = _rows(text), _rows(printed[run])
            assert [r["tokens"] for r in got] == [r["tokens"] for r in want], f"{name} {run}"
            assert [r["prompt_tokens"] for r in want][1] > 16  # longer than index_topk: the indexer selects
            steps, ref_steps = torch.load(out / f"{run}.pt"), torch.load(ref_dir / f"{run}.pt")
            assert len(steps) == len(ref_steps) == 8
            worst = max(_rel(a, b) for a, b in zip(steps, ref_steps))
            print(f"{name} {run}: worst per-step logits relative difference {worst:.2e}")
            assert worst <= RTOL, f"{name} {run}: logits differ from one process's by {worst:.2e}"


def test_layouts_decoding_cannot_run_are_one_line(checkpoints, capsys):
    load = ["--load", checkpoints["training"], "--prompt", "hi"]
    msg = one_line_error(capsys, load + ["--tp", "2"])
    assert ("world size 1 is not divisible by --tp 2 x --pp 1 x --cp 1 = 2; this is a single process: launch 2 "
            "with torchrun, e.g. torchrun --nproc-per-node 2 tools/generate.py <the same flags>") in msg
    msg = one_line_error(capsys, load + ["--ep", "3"], env={"WORLD_SIZE": "2"})
    assert "world size 2 is not divisible by --etp 1 x --ep 3 x --pp 1 = 3 (the expert layout)" in msg
    assert "--cp 2: decoding runs without context parallelism" in one_line_error(capsys, load + ["--cp", "2"])
    assert "--sequence-parallel: decoding runs without it" in one_line_error(
        capsys, load + ["--tp", "2", "--sequence-parallel"])
    assert "--vpp 2: decoding runs one model chunk per pipeline stage" in one_line_error(
        capsys, load + ["--pp", "2", "--vpp", "2"])
    assert "--pp 3 does not divide the model's 4 layers" in one_line_error(capsys, load + ["--pp", "3"],
                                                                          env={"WORLD_SIZE": "3"})
