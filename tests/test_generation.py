"""Generation (megatron_glm5/generation/, tools/generate.py): the cached decode equals full forwards, sampling,
perplexity through the training loss, the command line end to end and its bad input.

References are written here: full forwards of the plain model (no cache) over the whole sequence, argmax of
them, the training loop's own loss function over the model's per-token loss, and hand-computed filters.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import megatron_glm5
from megatron_glm5 import GLM5Config, build_model
from megatron_glm5.data.tokenizer import load_tokenizer
from megatron_glm5.generation.decode import cached_forward, generate
from megatron_glm5.generation.kv_cache import KVCache, cache_bytes_per_token
from megatron_glm5.generation.sampling import Sampler, SamplingError, SamplingParams, filter_logits, stop_token_ids

from generation_cli import one_line_error

REPO = Path(__file__).resolve().parents[1]
RTOL = 1e-5  # fp32 on CPU: the cached and the full forward differ only by summation order


def _model(preset: str, seed: int = 0, **overrides):
    megatron_glm5.initialize_model_parallel(seed=seed)
    return build_model(GLM5Config.from_preset(preset), mtp=False, dsa_backend="torch", **overrides).eval()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _full_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids)


@pytest.mark.parametrize("preset", ["tiny", "tiny-indexshare"])
def test_cached_decode_gives_the_full_forwards_logits_at_every_step(preset):
    """Two rows of different prompt lengths (5 and 19 > index_topk 16) prefilled together, then fed one token per
    step up to 30: each step's logits equal the full forward's at that position. Positions past index_topk
    really are sparse (a dense-attention model with the same weights differs there, and only there)."""
    model = _model(preset)
    cfg = GLM5Config.from_preset(preset)
    topk = model.config.dsa_index_topk
    n, prompt = 30, [5, 19]
    assert n > topk and prompt[1] > topk
    ids = torch.randint(1, cfg.vocab_size, (2, n), generator=torch.Generator().manual_seed(1))
    full = _full_logits(model, ids)

    cache = KVCache.for_model(model, 2, n)
    full_layers = {i + 1 for i in cfg.full_layers}
    assert {k[0] for k in cache.buffers if k[1] == "index"} == full_layers  # indexer keys: full layers only
    assert {k[0] for k in cache.buffers if k[1] == "kv"} == set(range(1, cfg.num_hidden_layers + 1))
    if preset == "tiny-indexshare":
        assert cfg.shared_layers, "the preset must have IndexShare layers"

    padded = torch.zeros(2, max(prompt), dtype=torch.int64)
    for i, p in enumerate(prompt):
        padded[i, :p] = ids[i, :p]
    positions = torch.arange(max(prompt)).expand(2, -1)
    first = cached_forward(model, cache, padded, positions, last=torch.tensor(prompt) - 1)[:, 0]
    errors = {}
    for i, p in enumerate(prompt):
        errors[(i, p - 1)] = _rel(first[i], full[i, p - 1])
    pos = torch.tensor(prompt)
    while int(pos.min()) < n:
        at = pos.clamp(max=n - 1)
        step = cached_forward(model, cache, ids[torch.arange(2), at][:, None], at[:, None])[:, 0]
        for i in range(2):
            if pos[i] < n:
                errors[(i, int(pos[i]))] = _rel(step[i], full[i, pos[i]])
        pos = pos + 1
    assert len(errors) == 2 * n - sum(prompt) + 2
    worst = max(errors.values())
    print(f"{preset}: cached vs full forward, worst relative difference {worst:.2e} over {len(errors)} steps")
    assert worst <= RTOL, f"worst relative difference {worst:.2e} at (row, position) {max(errors, key=errors.get)}"

    dense = _model(preset, dsa_stage="dense-warmup")
    dense.load_state_dict(model.state_dict())
    dense_logits = _full_logits(dense, ids)
    assert _rel(dense_logits[:, :topk], full[:, :topk]) <= RTOL  # up to top-k keys, sparse is dense
    assert _rel(dense_logits[:, topk:], full[:, topk:]) > 1e-3  # past it, the selection leaves keys out


def test_greedy_is_the_argmax_of_full_forwards_and_stops_at_a_stop_token():
    model = _model("tiny-indexshare", seed=2)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 512, (14,), generator=g).tolist(), torch.randint(1, 512, (6,), generator=g).tolist()]
    out = generate(model, prompts, max_new_tokens=8, sampling=SamplingParams(greedy=True))
    for prompt, res in zip(prompts, out):
        assert len(res.tokens) == 8 and res.finish_reason == "length"
        seq = list(prompt)
        for token in res.tokens:  # generation crosses index_topk (16): 14 + 8 tokens
            assert token == int(_full_logits(model, torch.tensor([seq]))[0, -1].argmax())
            seq.append(token)
    alone = generate(model, prompts[1:], max_new_tokens=8, sampling=SamplingParams(greedy=True))
    assert alone[0].tokens == out[1].tokens  # batching with a longer prompt changes nothing
    stop = out[0].tokens[3]
    first = out[0].tokens.index(stop)
    stopped = generate(model, prompts[:1], max_new_tokens=8, sampling=SamplingParams(greedy=True), stop_ids=[stop])
    assert stopped[0].tokens == out[0].tokens[:first + 1] and stopped[0].finish_reason == "stop"


def test_sampling_with_a_seed_is_reproducible_and_the_filters_keep_the_right_tokens():
    model = _model("tiny", seed=4)
    prompts = [[5, 6, 7, 8], [9, 10]]
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7)
    a = [r.tokens for r in generate(model, prompts, 10, params)]
    b = [r.tokens for r in generate(model, prompts, 10, params)]
    c = [r.tokens for r in generate(model, prompts, 10, SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=8))]
    assert a == b and a != c

    # probabilities 0.05, 0.5, 0.15, 0.3 (shuffled, so that the filters must map sorted ranks back)
    logits = torch.tensor([[0.05, 0.5, 0.15, 0.3]]).log()
    kept = lambda **kw: torch.isfinite(filter_logits(logits, **kw))[0].tolist()
    assert kept(top_p=0.7) == [False, True, False, True]  # 0.5 + 0.3 reach 0.7
    assert kept(top_p=0.8) == [False, True, False, True]  # exactly 0.8: the third is not needed
    assert kept(top_p=0.81) == [False, True, True, True]
    assert kept(top_p=0.3) == [False, True, False, False]  # the most likely token always stays
    assert kept(top_k=3) == [False, True, True, True]
    assert kept(top_k=2, top_p=0.5) == [False, True, False, False]
    greedy_like = Sampler(SamplingParams(temperature=2.0, top_k=1, seed=0))
    assert greedy_like(logits).tolist() == [1]
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2)):
        with pytest.raises(SamplingError):
            SamplingParams(**bad)
    tok = load_tokenizer("tiny")
    assert stop_token_ids([154820, 154827, 154829], None) == [154820, 154827, 154829]
    assert stop_token_ids(0, tok) == sorted({0, tok.special_ids["<|user|>"], tok.special_ids["<|observation|>"]})


def test_cache_bytes_per_token():
    # GLM-5 / 5.1: 78 layers, each [512 latent | 64 rope] and a 128-dim indexer key, bf16
    assert cache_bytes_per_token(GLM5Config.from_preset("glm5")) == 78 * (512 + 64) * 2 + 78 * 128 * 2
    # GLM-5.3: IndexShare, 21 full-indexer layers
    assert cache_bytes_per_token(GLM5Config.from_preset("glm5.3")) == 78 * (512 + 64) * 2 + 21 * 128 * 2
    model = _model("tiny-indexshare")  # 4 layers of [16 | 8], 2 full indexers of 16, fp32
    assert KVCache.for_model(model, 1, 8).bytes_per_token() == 4 * (16 + 8) * 4 + 2 * 16 * 4
    assert KVCache.for_model(model, 1, 8).bytes_per_token() == cache_bytes_per_token(
        GLM5Config.from_preset("tiny-indexshare"), bytes_per_value=4)


def _eval_file(path: Path) -> Path:
    rows = [{"text": "The cat sat on the mat, and then it slept for a while."},
            {"messages": [{"role": "user", "content": "What is 3 plus 4?"},
                          {"role": "assistant", "content": "7.", "reasoning_content": "3 + 4 = 7"},
                          {"role": "user", "content": "And 5 plus 5?"},
                          {"role": "assistant", "content": "10."}]},
            {"text": "Short."}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_eval_perplexity_is_exp_of_the_training_loss(tmp_path):
    """ppl = exp(sum of the training loss over the predicted tokens / their count): the training loop's loss
    function on the model's per-token loss, text records predicting every token (+ <|endoftext|>), chats only the
    assistant's tokens (the SFT mask)."""
    from megatron_glm5.data.sft import tokenize_chat
    from megatron_glm5.generation.perplexity import perplexity
    from megatron_glm5.training.loop import _loss_func

    model = _model("tiny", seed=5)
    tok = load_tokenizer("tiny")
    path = _eval_file(tmp_path / "eval.jsonl")
    got = perplexity(model, tok, str(path))

    loss_sum, count, ce_sum = 0.0, 0, 0.0
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "text" in rec:
            ids = tok.encode(rec["text"]) + [tok.eod_id]
            mask = [1] * len(ids)
        else:
            ids, mask = tokenize_chat(tok, rec["messages"])
        x = torch.tensor([ids])
        loss_mask = torch.tensor([mask[1:]], dtype=torch.float32)
        with torch.no_grad():
            s, n, _ = _loss_func(loss_mask, model(x[:, :-1], labels=x[:, 1:]))
            logits = model(x[:, :-1])[0]
        loss_sum, count = loss_sum + float(s), count + int(n)
        ce = torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="none")
        ce_sum += float((ce * loss_mask[0]).sum())
    assert got["tokens"] == count and got["records"] == 3
    assert got["ppl"] == pytest.approx(math.exp(loss_sum / count), rel=1e-6)
    assert got["nll"] == pytest.approx(ce_sum / count, rel=1e-5)


def test_generate_tool_end_to_end_on_a_training_checkpoint(layouts_reference, tmp_path, capsys):
    """tools/generate.py (a real process) on the 1-step tiny checkpoint of the layout tests: greedy chat output
    equals generate() on api.load_checkpoint of the same checkpoint; --eval (in process) prints the ppl that
    perplexity() computes."""
    from megatron_glm5.api import load_checkpoint
    from megatron_glm5.generation import cli
    from megatron_glm5.generation.perplexity import perplexity

    start = str(layouts_reference[0])
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    cmd = [sys.executable, str(REPO / "tools" / "generate.py"), "--load", start, "--prompt", "What is 3 plus 4?",
           "--prompt", "Hi", "--chat", "--greedy", "--max-new-tokens", "6", "--json"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert [r["index"] for r in lines] == [1, 2]

    model = load_checkpoint(start, mtp=False, dsa_backend="torch")
    tok = load_tokenizer("tiny")
    stops = stop_token_ids(model.glm5_config.eos_token_id, tok)
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
               for t in ("What is 3 plus 4?", "Hi")]
    ref = generate(model, prompts, 6, SamplingParams(greedy=True), stops)
    for row, r in zip(lines, ref):
        assert row["tokens"] == r.tokens and row["finish_reason"] == r.finish_reason
        assert row["prompt_tokens"] == len(prompts[lines.index(row)])
    assert "sampling seed" in proc.stderr and "(greedy)" in proc.stderr

    path = _eval_file(tmp_path / "eval.jsonl")
    capsys.readouterr()
    assert cli.main(["--load", start, "--eval", str(path)]) == 0
    out = capsys.readouterr().out
    printed = json.loads(out.split("eval ", 2)[-1])
    assert printed["ppl"] == pytest.approx(perplexity(model, tok, str(path))["ppl"], rel=1e-9)


def test_bad_input_is_one_line(tmp_path, capsys):
    from hf_tiny import make_hf_model, save_hf_model

    hf_dir = tmp_path / "hf"
    save_hf_model(make_hf_model("tiny", seed=0)[0], hf_dir)
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                   "hidden_size": 64}))
    long_file = tmp_path / "long.jsonl"
    long_file.write_text(json.dumps({"prompt": "a " * 4200}) + "\n")
    empty_file = tmp_path / "empty.jsonl"
    empty_file.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"prompt": ""}) + "\n")

    msg = one_line_error(capsys, ["--prompt", "hi"])
    assert "--load" in msg and "--hf-dir" in msg
    assert "--load /no/such/dir: no such directory" in one_line_error(capsys, ["--load", "/no/such/dir",
                                                                                "--prompt", "hi"])
    assert f"--prompts-file {tmp_path}/missing.jsonl: no such file" in one_line_error(
        capsys, ["--hf-dir", hf_dir, "--prompts-file", tmp_path / "missing.jsonl"])
    assert "--prompt 1: empty prompt" in one_line_error(capsys, ["--hf-dir", hf_dir, "--prompt", "  "])
    assert f"{empty_file}:2: empty prompt" in one_line_error(capsys, ["--hf-dir", hf_dir, "--prompts-file",
                                                                       empty_file])
    msg = one_line_error(capsys, ["--hf-dir", hf_dir, "--prompts-file", long_file])
    assert "prompt 1 has 4201 tokens, the model's max_position_embeddings is 4096" in msg
    assert "model_type" in one_line_error(capsys, ["--hf-dir", other, "--prompt", "hi"])
    msg = one_line_error(capsys, ["--hf-dir", hf_dir, "--prompt", "hi"], env={"WORLD_SIZE": "2"})
    assert "runs in one process (WORLD_SIZE=2)" in msg
    long_eval = tmp_path / "long_eval.jsonl"
    long_eval.write_text(json.dumps({"text": "a " * 4200}) + "\n")
    msg = one_line_error(capsys, ["--hf-dir", hf_dir, "--eval", long_eval])
    assert f"{long_eval}:1: 4202 tokens, more than the model's max_position_embeddings (4096) + 1" in msg
    assert "--top-p 0.0: must be in (0, 1]" in one_line_error(capsys, ["--hf-dir", hf_dir, "--prompt", "hi",
                                                                       "--top-p", "0"])
    small = tmp_path / "small_vocab"
    save_hf_model(make_hf_model("tiny", seed=0, vocab_size=256)[0], small)
    msg = one_line_error(capsys, ["--hf-dir", small, "--prompt", "hi"])
    assert "--tokenizer tiny: 512 token ids, the model's vocabulary has 256" in msg


def test_decode_benchmark_runs_on_cpu(capsys):
    """benchmarks/decode.py at a tiny size (the figures are the H200's to fill): its check agrees with the cache."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_decode_benchmark", REPO / "benchmarks" / "decode.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = bench.main(["--device", "cpu", "--preset", "tiny-indexshare", "--prompt-len", "20", "--new-tokens", "4",
                      "--batch", "2", "--attn", "torch"])
    (row,) = out["results"]
    assert out["model"]["indexer_types"] == ["full", "shared"]
    assert row["check_greedy_agreement"] == 1.0 and row["check_last_logits_rel_diff"] <= RTOL
    assert row["cache_bytes_per_token"] == 2 * (16 + 8) * 4 + 16 * 4
