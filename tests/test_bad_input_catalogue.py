"""The bad-input catalogue (docs/bad_input.md): every case run through the real entry points.

Each case calls an entry point's main() in this process (finetune_glm5.py / pretrain_glm5.py through
megatron_glm5.training.entry.main, tools/preprocess_data.py, tools/convert_*.py and tools/verify_conversion.py
through their main(argv)) and checks one of two behaviours:

- stop: a non-zero exit status and exactly one line ``error: ...`` on stderr, naming the flag or the file (with
  its line for a data line), no traceback;
- skip: the run finishes (status 0), and the skipped sample is counted in the log, per file.

A few cases run as real subprocesses to check the exit status the shell sees. Cases covered elsewhere at the
same entry-point level are listed in docs/bad_input.md with the test that covers them.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_glm5.data import TINY_CHAT_TRAIN, TINY_PRETRAIN_A, TINY_TOKENIZER_DIR

REPO = Path(__file__).resolve().parents[1]
# a few quick training steps on small data (the shipped files hold 2000 conversations / documents)
QUICK = ["--train-iters", "2", "--log-interval", "1", "--eval-iters", "0", "--no-save", "--micro-batch-size", "2",
         "--seq-length", "64"]


# ------------------------------------------------------------------------------------------------ running mains


def _tool_main(name: str):
    spec = importlib.util.spec_from_file_location(f"_tool_{name}", REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _entry(mode):
    def run(argv):
        from megatron_glm5.training.entry import main
        return main(mode, argv)
    return run


def _conversion(name):
    def run(argv):
        from megatron_glm5.conversion import cli
        return getattr(cli, name)(argv)
    return run


ENTRIES = {
    "finetune": _entry("finetune"),
    "pretrain": _entry("pretrain"),
    "preprocess": lambda argv: _tool_main("preprocess_data")(argv),
    "convert_hf_to_megatron": _conversion("hf_to_megatron_main"),
    "convert_megatron_to_hf": _conversion("megatron_to_hf_main"),
    "verify": _conversion("verify_main"),
}


def run_main(entry: str, argv, capsys):
    """(exit status, stdout, stderr) of an entry point's main() called in this process."""
    capsys.readouterr()
    try:
        rc = ENTRIES[entry]([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return rc, out.out, out.err


def assert_stops(rc, err, *needles):
    assert rc not in (0, None), f"exit status {rc}; stderr:\n{err[-3000:]}"
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], err[-3000:]
    for needle in needles:
        assert str(needle) in errors[0], f"{needle!r} not in {errors[0]!r}"
    print(f"CATALOGUE {errors[0]}")  # shown by pytest -rP
    return errors[0]


# ------------------------------------------------------------------------------------------------ bad inputs


def _chat_lines(n):
    lines = [x for x in Path(TINY_CHAT_TRAIN).read_text(encoding="utf-8").splitlines() if x.strip()]
    return lines[:n]


def _text_lines(n):
    lines = [x for x in Path(TINY_PRETRAIN_A).read_text(encoding="utf-8").splitlines() if x.strip()]
    return lines[:n]


def _write(path: Path, data) -> Path:
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data, encoding="utf-8")
    return path


def _with_line_3(good, bad):
    """good[0], good[1], bad, good[2:]: the bad record on line 3."""
    return "\n".join(good[:2] + [bad] + good[2:]) + "\n"


LATIN1_CHAT = '{"messages": [{"role": "user", "content": "caf\xe9?"}, {"role": "assistant", "content": "Oui."}]}'
LATIN1_TEXT = '{"text": "caf\xe9 au lait"}'
SFT_BAD_LINES = {  # case -> (line 3 of an SFT file, reason counted when skipped, words of the error)
    "malformed_json": ('{"messages": [oops', "malformed_json", ["malformed JSON"]),
    "missing_messages": ('{"conversation": []}', "missing_field", ["missing required field 'messages'"]),
    "wrong_role": ('{"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "ok"}]}',
                   "bad_chat", ["messages[0].role 'robot'"]),
    "empty_document": ('{"messages": []}', "bad_chat", ["'messages' is empty"]),
    "no_assistant_turn": ('{"messages": [{"role": "user", "content": "hi"}]}', "bad_chat", ["no assistant message"]),
    "non_utf8": (LATIN1_CHAT.encode("latin-1"), "invalid_utf8", ["not valid UTF-8"]),
    "lone_surrogate": ('{"messages": [{"role": "user", "content": "x\\ud800"}, {"role": "assistant", "content": '
                       '"ok"}]}', "lone_surrogate", ["field 'messages[0].content' holds a lone UTF-16 surrogate"]),
}
PRETRAIN_BAD_LINES = {
    "malformed_json": ('{"text": "unterminated', "malformed_json", ["malformed JSON"]),
    "missing_text": ('{"content": "no text key"}', "missing_field", ["missing required field 'text'"]),
    "text_not_a_string": ('{"text": 42}', "wrong_type", ["field 'text' must be a string"]),
    "non_utf8": (LATIN1_TEXT.encode("latin-1"), "invalid_utf8", ["not valid UTF-8"]),
    "lone_surrogate": ('{"text": "bad \\ud800 here"}', "lone_surrogate",
                       ["field 'text' holds a lone UTF-16 surrogate '\\ud800' (character 5)"]),
}


def _data_file(tmp_path, good, bad) -> Path:
    if isinstance(bad, bytes):
        raw = b"\n".join([g.encode() for g in good[:2]] + [bad] + [g.encode() for g in good[2:]]) + b"\n"
        return _write(tmp_path / "data.jsonl", raw)
    return _write(tmp_path / "data.jsonl", _with_line_3(good, bad))


def _sft_flags(data, tmp_path):
    return QUICK + ["--data-path", data, "--valid-data-path", data, "--tensorboard-dir", tmp_path / "tb"]


def _pretrain_flags(data, tmp_path):
    return QUICK + ["--data-path", data, "--split", "100,0,0", "--data-cache-path", tmp_path / "cache",
                    "--tensorboard-dir", tmp_path / "tb"]


@pytest.fixture(autouse=True)
def _quiet_env(monkeypatch, caplog):
    monkeypatch.delenv("MEGATRON_GLM5_TRACEBACK", raising=False)
    monkeypatch.delenv("MEGATRON_GLM5_INJECT_FAULT", raising=False)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    caplog.set_level(logging.INFO)


def _skip_summary(caplog, path) -> str:
    """The end-of-run line of the skipped-samples summary for one file."""
    lines = [r.getMessage().strip() for r in caplog.records]
    assert any(line.startswith("skipped samples:") for line in lines), lines[-20:]
    mine = [line for line in lines if line.startswith(f"{path}: ") and " skipped (" in line]
    assert mine, lines[-20:]
    return mine[-1]


# ---- data lines: stop without --skip-bad-samples, counted skip with it


@pytest.mark.parametrize("case", sorted(SFT_BAD_LINES))
def test_finetune_bad_line(case, tmp_path, capsys, caplog):
    bad, reason, words = SFT_BAD_LINES[case]
    data = _data_file(tmp_path, _chat_lines(12), bad)
    rc, _, err = run_main("finetune", _sft_flags(data, tmp_path), capsys)
    assert_stops(rc, err, f"{data}:3:", *words)
    rc, out, err = run_main("finetune", _sft_flags(data, tmp_path) + ["--skip-bad-samples"], capsys)
    assert rc == 0, err[-3000:]
    # train and valid read the same file: each pass counts its line 3
    assert _skip_summary(caplog, data).startswith(f"{data}: 2 skipped ({reason} 2); first: {data}:3:")


@pytest.mark.parametrize("case", sorted(PRETRAIN_BAD_LINES))
def test_pretrain_bad_line(case, tmp_path, capsys, caplog):
    bad, reason, words = PRETRAIN_BAD_LINES[case]
    data = _data_file(tmp_path, _text_lines(40), bad)
    rc, _, err = run_main("pretrain", _pretrain_flags(data, tmp_path), capsys)
    assert_stops(rc, err, f"{data}:3:", *words)
    rc, out, err = run_main("pretrain", _pretrain_flags(data, tmp_path) + ["--skip-bad-samples"], capsys)
    assert rc == 0, err[-3000:]
    assert _skip_summary(caplog, data).startswith(f"{data}: 1 skipped ({reason} 1); first: {data}:3:")
    # a second run reuses the cached index and still reports what was skipped when it was built
    caplog.clear()
    rc, out, err = run_main("pretrain", _pretrain_flags(data, tmp_path) + ["--skip-bad-samples"], capsys)
    assert rc == 0, err[-3000:]
    assert _skip_summary(caplog, data).startswith(f"{data}: 1 skipped ({reason} 1)")


@pytest.mark.parametrize("case", sorted(PRETRAIN_BAD_LINES))
def test_preprocess_bad_line(case, tmp_path, capsys, caplog):
    bad, reason, words = PRETRAIN_BAD_LINES[case]
    data = _data_file(tmp_path, _text_lines(6), bad)
    prefix = tmp_path / "out" / "corpus"
    flags = ["--input", data, "--output-prefix", prefix, "--no-progress"]
    rc, _, err = run_main("preprocess", flags, capsys)
    assert rc == 2
    assert_stops(rc, err, f"{data}:3:", *words)
    assert not list((tmp_path / "out").glob("corpus*")), "a failed run must leave no output"
    rc, out, err = run_main("preprocess", flags + ["--skip-bad-lines"], capsys)
    assert rc == 0, err
    assert "6 documents" in out and "1 bad lines skipped" in out, out
    assert f"{data}:3:" in caplog.text and f"{reason} 1" in caplog.text, caplog.text


# ---- files


@pytest.mark.parametrize("entry", ["finetune", "pretrain", "preprocess"])
@pytest.mark.parametrize("content", ["", "\n\n"], ids=["zero_bytes", "blank_lines"])
def test_empty_data_file(entry, content, tmp_path, capsys):
    data = _write(tmp_path / "empty.jsonl", content)
    if entry == "preprocess":
        flags = ["--input", data, "--output-prefix", tmp_path / "out", "--no-progress"]
    else:
        flags = (_sft_flags if entry == "finetune" else _pretrain_flags)(data, tmp_path)
    rc, _, err = run_main(entry, flags, capsys)
    assert_stops(rc, err, str(data), "empty")


def test_pretrain_empty_documents_are_counted(tmp_path, capsys, caplog):
    """Documents whose text is empty are left out (counted by preprocess_data.py); a file of nothing else stops."""
    good = _text_lines(6)
    data = _write(tmp_path / "data.jsonl", "\n".join(good[:3] + ['{"text": ""}'] + good[3:]) + "\n")
    rc, out, err = run_main("preprocess", ["--input", data, "--output-prefix", tmp_path / "p", "--no-progress"],
                            capsys)
    assert rc == 0 and "6 documents" in out and "1 empty" in out, (out, err)
    only_empty = _write(tmp_path / "only_empty.jsonl", '{"text": ""}\n{"text": ""}\n')
    rc, _, err = run_main("pretrain", _pretrain_flags(only_empty, tmp_path), capsys)
    assert_stops(rc, err, str(only_empty), "no documents")


def test_data_path_is_a_directory_or_missing(tmp_path, capsys):
    rc, _, err = run_main("finetune", _sft_flags(tmp_path, tmp_path), capsys)
    assert_stops(rc, err, "--data-path", str(tmp_path), "directory")
    missing = tmp_path / "nowhere"
    rc, _, err = run_main("pretrain", _pretrain_flags(missing, tmp_path), capsys)
    assert_stops(rc, err, "--data-path", str(missing), "preprocess_data.py")


# ---- over-long samples: truncated or dropped and counted


def test_overlong_sample_dropped_and_counted(tmp_path, capsys, caplog):
    long_chat = {"messages": [{"role": "user", "content": "Count."},
                              {"role": "assistant", "content": " ".join(f"w{i}" for i in range(300))}]}
    data = _write(tmp_path / "data.jsonl", _with_line_3(_chat_lines(12), json.dumps(long_chat)))
    rc, _, err = run_main("finetune", _sft_flags(data, tmp_path) + ["--overlong", "drop", "--no-packing"], capsys)
    assert rc == 0, err[-3000:]
    assert _skip_summary(caplog, data).startswith(f"{data}: 2 skipped (overlong 2)")


# ---- tokenizers


def test_tokenizer_vocab_larger_than_model(tmp_path, capsys):
    from tokenizers import Tokenizer

    tok_dir = shutil.copytree(TINY_TOKENIZER_DIR, tmp_path / "big")
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    tok.add_tokens([f"extra_{i}" for i in range(100)])
    tok.save(str(tok_dir / "tokenizer.json"))
    data = _write(tmp_path / "data.jsonl", "\n".join(_chat_lines(8)) + "\n")
    rc, _, err = run_main("finetune", _sft_flags(data, tmp_path) + ["--tokenizer", tok_dir], capsys)
    assert_stops(rc, err, "--tokenizer", str(tok_dir), "612", "vocab_size 512")


@pytest.mark.parametrize("entry", ["finetune", "pretrain", "preprocess"])
def test_unreadable_tokenizer_file(entry, tmp_path, capsys):
    tok_dir = shutil.copytree(TINY_TOKENIZER_DIR, tmp_path / "broken")
    (tok_dir / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nope"')
    data = _write(tmp_path / "data.jsonl", "\n".join(_text_lines(8) if entry != "finetune" else _chat_lines(8)))
    if entry == "preprocess":
        flags = ["--input", data, "--output-prefix", tmp_path / "out", "--tokenizer", tok_dir, "--no-progress"]
    else:
        flags = (_sft_flags if entry == "finetune" else _pretrain_flags)(data, tmp_path) + ["--tokenizer", tok_dir]
    rc, _, err = run_main(entry, flags, capsys)
    assert_stops(rc, err, str(tok_dir), *(["--tokenizer"] if entry != "preprocess" else []))


@pytest.mark.parametrize("entry", ["finetune", "preprocess"])
def test_missing_tokenizer(entry, tmp_path, capsys):
    data = _write(tmp_path / "data.jsonl", "\n".join(_chat_lines(8)))
    missing = tmp_path / "no_tokenizer"
    if entry == "preprocess":
        flags = ["--input", data, "--output-prefix", tmp_path / "out", "--tokenizer", missing, "--no-progress"]
    else:
        flags = _sft_flags(data, tmp_path) + ["--tokenizer", missing]
    rc, _, err = run_main(entry, flags, capsys)
    assert_stops(rc, err, str(missing), "not found", *(["--tokenizer"] if entry != "preprocess" else []))


# ---- flags


BAD_FLAGS = {  # case -> (mode, flags, words of the error)
    "global_batch_not_divisible": ("finetune", ["--global-batch-size", "3", "--micro-batch-size", "2"],
                                   ["--global-batch-size 3", "--micro-batch-size 2"]),
    "lr_below_min_lr": ("finetune", ["--lr", "1e-5", "--min-lr", "1e-3"], ["--lr", "--min-lr"]),
    "overlap_param_gather_alone": ("pretrain", ["--overlap-param-gather"], ["--overlap-param-gather",
                                                                            "--use-distributed-optimizer"]),
    "fp16": ("finetune", ["--fp16"], ["--fp16"]),
    "finetune_without_load": ("finetune", ["--finetune"], ["--finetune", "--load"]),
    "max_skipped_steps_zero": ("finetune", ["--max-skipped-steps", "0"], ["--max-skipped-steps"]),
    "negative_spike_threshold": ("pretrain", ["--loss-spike-threshold", "-1"], ["--loss-spike-threshold"]),
    "unknown_flag": ("pretrain", ["--tensor-parallel", "2"], ["--tensor-parallel"]),
    "pp_not_dividing_layers": ("finetune", ["--pp", "3"], ["--pp"]),
    "ep_without_torchrun": ("finetune", ["--ep", "2"], ["world size 1 is not divisible by --etp 1 x --ep 2",
                                                       "launch 2 with torchrun, e.g. torchrun --nproc-per-node 2 "
                                                       "finetune_glm5.py <the same flags>"]),
    "seq_length_1_finetune": ("finetune", ["--seq-length", "1"], ["--seq-length 1 is too short", "at least 2"]),
    "seq_length_1_pretrain": ("pretrain", ["--seq-length", "1"], ["--seq-length 1 is too short", "at least 2",
                                                                  "--no-mtp"]),
}


@pytest.mark.parametrize("case", sorted(BAD_FLAGS))
def test_bad_flags(case, tmp_path, capsys):
    mode, flags, words = BAD_FLAGS[case]
    rc, _, err = run_main(mode, flags + ["--no-save"], capsys)
    assert_stops(rc, err, *words)


def test_fault_injection_hook_typo_is_an_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MEGATRON_GLM5_INJECT_FAULT", "nan-grads:3")
    data = _write(tmp_path / "data.jsonl", "\n".join(_chat_lines(8)))
    rc, _, err = run_main("finetune", _sft_flags(data, tmp_path), capsys)
    assert_stops(rc, err, "MEGATRON_GLM5_INJECT_FAULT", "nan-grads:3")


# ---- checkpoints


@pytest.mark.parametrize("entry", ["finetune", "pretrain", "convert_megatron_to_hf", "verify"])
def test_load_is_not_a_checkpoint(entry, tmp_path, capsys):
    not_ckpt = tmp_path / "not_a_checkpoint"
    not_ckpt.mkdir()
    (not_ckpt / "notes.txt").write_text("hello")
    if entry == "convert_megatron_to_hf":
        flags = ["--load", not_ckpt, "--save", tmp_path / "out", "--no-progress"]
    elif entry == "verify":
        flags = ["--hf-dir", _safetensors_dir(tmp_path), "--load", not_ckpt]
    else:
        data = _write(tmp_path / "data.jsonl", "\n".join(_chat_lines(8) if entry == "finetune" else _text_lines(8)))
        flags = (_sft_flags if entry == "finetune" else _pretrain_flags)(data, tmp_path) + ["--load", not_ckpt]
    rc, _, err = run_main(entry, flags, capsys)
    assert_stops(rc, err, "--load", str(not_ckpt))
    assert not (tmp_path / "out").exists()


def test_hf_dir_is_not_a_model(tmp_path, capsys):
    empty = tmp_path / "hf"
    empty.mkdir()
    rc, _, err = run_main("convert_hf_to_megatron", ["--hf-dir", empty, "--save", tmp_path / "out"], capsys)
    assert_stops(rc, err, "--hf-dir", str(empty), "config.json")
    rc, _, err = run_main("verify", ["--hf-dir", empty, "--megatron", tmp_path / "ckpt"], capsys)
    assert_stops(rc, err, str(empty))


# ---- safetensors: truncated files and index entries naming what is not there


def _safetensors_dir(tmp_path) -> Path:
    """A small HF-style directory: config.json of the tiny preset and two shards with an index."""
    from safetensors.torch import save_file

    from megatron_glm5 import GLM5Config

    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(GLM5Config.from_preset("tiny").to_hf()))
    shards = {"model-00001-of-00002.safetensors": {"model.embed_tokens.weight": torch.ones(512, 64)},
              "model-00002-of-00002.safetensors": {"lm_head.weight": torch.ones(512, 64)}}
    weight_map = {}
    for name, tensors in shards.items():
        save_file(tensors, str(d / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


def _truncate(d):
    p = d / "model-00002-of-00002.safetensors"
    p.write_bytes(p.read_bytes()[:-1000])
    return [p.name, "truncated"]


def _truncate_header(d):
    p = d / "model-00001-of-00002.safetensors"
    p.write_bytes(p.read_bytes()[:6])
    return [p.name, "not a safetensors file"]


def _index_names_missing_file(d):
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = "model-00003-of-00003.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return ["model-00003-of-00003.safetensors", "missing"]


def _index_names_missing_tensor(d):
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "model-00001-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return ["model-00001-of-00002.safetensors", "does not contain model.norm.weight"]


def _index_not_json(d):
    (d / "model.safetensors.index.json").write_text("{not json")
    return ["model.safetensors.index.json", "not a valid safetensors index"]


SAFETENSORS_CASES = {"truncated_data": _truncate, "truncated_header": _truncate_header,
                     "index_names_missing_file": _index_names_missing_file,
                     "index_names_missing_tensor": _index_names_missing_tensor, "index_not_json": _index_not_json}


@pytest.mark.parametrize("entry", ["convert_hf_to_megatron", "verify"])
@pytest.mark.parametrize("case", sorted(SAFETENSORS_CASES))
def test_broken_safetensors(case, entry, tmp_path, capsys):
    d = _safetensors_dir(tmp_path)
    words = SAFETENSORS_CASES[case](d)
    out = tmp_path / "out"
    if entry == "verify":
        flags = ["--hf-dir", d, "--megatron", tmp_path / "ckpt"]
    else:
        flags = ["--hf-dir", d, "--save", out, "--no-progress"]
    rc, _, err = run_main(entry, flags, capsys)
    assert rc == 2
    assert_stops(rc, err, *words)
    assert not out.exists() and not (tmp_path / "out.partial").exists()


# ------------------------------------------------------------------------------------------------ real processes


def _start(args, cwd):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for var in ("MEGATRON_GLM5_TRACEBACK", "MEGATRON_GLM5_INJECT_FAULT", "RANK", "WORLD_SIZE", "MASTER_ADDR"):
        env.pop(var, None)
    return subprocess.Popen([sys.executable, *map(str, args)], cwd=str(cwd), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_exit_status_of_real_processes(tmp_path):
    """What the shell sees: status 2 and one stderr line, for a mistyped field (preprocess_data.py) and an index
    naming a missing tensor (verify_conversion.py), run at once. (The training entry points' exit status is checked
    in subprocesses by test_training_cpu.py's bad-input tests.)"""
    (tmp_path / "t").mkdir()
    text = _data_file(tmp_path / "t", _text_lines(8), '{"text": 1}')
    d = _safetensors_dir(tmp_path)
    _index_names_missing_tensor(d)
    procs = [
        _start([REPO / "tools" / "preprocess_data.py", "--input", text, "--output-prefix", tmp_path / "p"], tmp_path),
        _start([REPO / "tools" / "verify_conversion.py", "--hf-dir", d, "--megatron", tmp_path / "x"], tmp_path),
    ]
    needles = [f"{text}:3: field 'text' must be a string", "does not contain"]
    try:
        results = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for proc, (_, stderr), needle in zip(procs, results, needles):
        assert proc.returncode == 2, (proc.args, stderr[-2000:])
        errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and needle in errors[0] and "Traceback" not in stderr, stderr[-2000:]


# ------------------------------------------------------------------------------------------------ issue 21 / 20 cases


@pytest.mark.parametrize("entry", ["finetune", "pretrain", "preprocess"])
def test_overlong_line_refused_before_decoding(entry, tmp_path, capsys, caplog):
    """A line over --max-sample-bytes stops the run naming file:line and the flag, or is skipped and counted."""
    if entry == "finetune":
        good, bad = _chat_lines(12), json.dumps({"messages": [{"role": "user", "content": "x" * 2000},
                                                              {"role": "assistant", "content": "ok"}]})
    else:
        good, bad = _text_lines(40), json.dumps({"text": "y" * 2000})
    data = _data_file(tmp_path, good, bad)
    size = len(bad.encode())
    if entry == "preprocess":
        flags = ["--input", data, "--output-prefix", tmp_path / "out" / "p", "--no-progress",
                 "--max-sample-bytes", 1000]
        skip = ["--skip-bad-lines"]
    else:
        flags = (_sft_flags if entry == "finetune" else _pretrain_flags)(data, tmp_path) + ["--max-sample-bytes", 1000]
        skip = ["--skip-bad-samples"]
    rc, _, err = run_main(entry, flags, capsys)
    assert_stops(rc, err, f"{data}:3: line of {size} bytes is longer than --max-sample-bytes 1000")
    rc, out, err = run_main(entry, flags + skip, capsys)
    assert rc == 0, err[-3000:]
    if entry == "preprocess":
        assert "1 bad lines skipped" in out and "too_long 1" in caplog.text, (out, caplog.text)
    else:
        n = 2 if entry == "finetune" else 1  # finetune reads the file for training and validation
        assert _skip_summary(caplog, data).startswith(f"{data}: {n} skipped (too_long {n}); first: {data}:3:")


def test_default_max_sample_bytes_bounds_a_line(tmp_path, capsys):
    """The default (8 MiB) refuses a 9 MiB line without decoding it."""
    data = _write(tmp_path / "big.jsonl", "\n".join(_text_lines(3) + [json.dumps({"text": "z" * (9 << 20)})]) + "\n")
    rc, _, err = run_main("preprocess", ["--input", data, "--output-prefix", tmp_path / "p", "--no-progress"], capsys)
    assert_stops(rc, err, f"{data}:4: line of {(9 << 20) + 12} bytes is longer than --max-sample-bytes 8388608 "
                          "(8 MiB)")


def test_preprocess_progress_lines_when_not_a_terminal(tmp_path, capsys, caplog):
    data = _write(tmp_path / "data.jsonl", "\n".join(_text_lines(600)) + "\n")
    size = data.stat().st_size
    rc, out, err = run_main("preprocess", ["--input", data, "--output-prefix", tmp_path / "p",
                                           "--progress-interval", 0], capsys)
    assert rc == 0, err
    lines = [r.getMessage() for r in caplog.records if "docs/s" in r.getMessage()]
    assert len(lines) >= 3, caplog.text[-2000:]  # one per batch of 256 lines (interval 0), and the final one
    assert lines[-1].startswith(f"p: 600 documents, {size / 1e3:.1f} kB of {size / 1e3:.1f} kB read (100%), ")
    caplog.clear()
    rc, out, err = run_main("preprocess", ["--input", data, "--output-prefix", tmp_path / "q", "--no-progress"], capsys)
    assert rc == 0 and not [r for r in caplog.records if "docs/s" in r.getMessage()]


def _broken_prefix(tmp_path, name, change):
    src = tmp_path / "good"
    if not (src.parent / "good.idx").exists():
        data = _write(tmp_path / "docs.jsonl", "\n".join(_text_lines(40)) + "\n")
        from megatron_glm5.data.preprocess import preprocess_jsonl
        preprocess_jsonl(data, src, "tiny", append_eod=True, progress=False)
    idx, bin_ = (tmp_path / "good.idx").read_bytes(), (tmp_path / "good.bin").read_bytes()
    idx, bin_ = change(idx, bin_)
    (tmp_path / f"{name}.idx").write_bytes(idx)
    (tmp_path / f"{name}.bin").write_bytes(bin_)
    return tmp_path / name


INDEXED_CASES = {  # case -> (change of (.idx, .bin), file named, words)
    "garbage_idx": (lambda i, b: (b"this is not an index at all\n" * 4, b), "idx", "not a Megatron index"),
    "truncated_idx": (lambda i, b: (i[:len(i) // 2], b), "idx", "truncated: 40 sequences and 41 document entries"),
    "header_only_idx": (lambda i, b: (i[:20], b), "idx", "shorter than the 34-byte header"),
    "truncated_bin": (lambda i, b: (i, b[:len(b) // 3]), "bin", "truncated"),
    "other_bin": (lambda i, b: (i, b + b"\x00" * 64), "bin", "not the data of this index"),
}


@pytest.mark.parametrize("case", sorted(INDEXED_CASES))
def test_garbage_or_truncated_indexed_dataset(case, tmp_path, capsys):
    change, named, words = INDEXED_CASES[case]
    prefix = _broken_prefix(tmp_path, case, change)
    flags = QUICK + ["--data-path", prefix, "--split", "100,0,0", "--data-cache-path", tmp_path / "cache"]
    rc, _, err = run_main("pretrain", flags, capsys)
    assert_stops(rc, err, f"--data-path {prefix}.{named}: ", words, "rebuild it with tools/preprocess_data.py")


def _hf_config(tmp_path, drop=(), **changes) -> Path:
    from megatron_glm5.config import GLM5Config

    d = GLM5Config.from_preset("tiny").to_hf()
    for k in drop:
        d.pop(k)
    d.update(changes)
    path = tmp_path / f"cfg{len(list(tmp_path.glob('cfg*')))}" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(d))
    return path


def test_hf_config_missing_or_inconsistent_fields(tmp_path, capsys):
    """No GLM-5 full-size defaults for a config.json's sizes; impossible sizes refused (flags only: nothing built)."""
    cases = [
        (dict(drop=("hidden_size",)), "missing required field hidden_size (not assumed to be GLM-5's 6144)"),
        (dict(drop=("hidden_size", "n_routed_experts", "index_topk")),
         "missing required fields hidden_size, n_routed_experts, index_topk (not assumed to be GLM-5's 6144, 256, "
         "2048); add them"),
        (dict(index_topk=8192), "index_topk (8192) exceeds max_position_embeddings (4096)"),
        (dict(first_k_dense_replace=5), "first_k_dense_replace (5) exceeds num_hidden_layers (4)"),
    ]
    for kw, words in cases:
        cfg = _hf_config(tmp_path, **kw)
        rc, _, err = run_main("finetune", ["--hf-config", cfg, "--no-save"], capsys)
        assert_stops(rc, err, f"--hf-config {cfg}: ", words)


def test_yaml_repeated_key(tmp_path, capsys):
    cfg = _write(tmp_path / "run.yaml", "train-iters: 2\nseed: 3\ntrain-iters: 4\n")
    rc, _, err = run_main("finetune", ["--config", cfg, "--no-save"], capsys)
    assert_stops(rc, err, f"--config {cfg}:3: key 'train-iters' is given twice (lines 1 and 3); keep one")


def test_repeated_data_path_is_warned(tmp_path, capsys, caplog):
    data = _write(tmp_path / "data.jsonl", "\n".join(_chat_lines(12)) + "\n")
    rc, _, err = run_main("finetune", QUICK + ["--data-path", data, data, "--valid-data-path", data], capsys)
    assert rc == 0, err[-3000:]
    warned = [r.getMessage() for r in caplog.records if "twice" in r.getMessage()]
    assert warned == [f"--data-path lists {data} twice (also as {data}): its samples are drawn twice as often; "
                      "list it once, or give blend weights"]


def test_small_corpus_split_through_pretrain_glm5(tmp_path):
    """pretrain_glm5.py on small corpora (real processes, a timeout: megatron-core looped forever on an empty split):
    50 documents at the default --split 98,1,1 train (the test split, empty, is not built), 20 documents leave the
    validation split empty: one line naming --split and the counts."""
    from training_helpers import assert_user_error, check_ok, run_entries

    runs = []
    for n in (50, 20):
        d = tmp_path / f"c{n}"
        d.mkdir()
        corpus = _write(d / "corpus.jsonl", "\n".join(_text_lines(n)) + "\n")
        runs.append(("pretrain", ["--train-iters", "2", "--eval-iters", "1", "--eval-interval", "2", "--no-save",
                                  "--micro-batch-size", "2", "--seq-length", "32", "--data-path", corpus,
                                  "--data-cache-path", d / "cache"], d))
    trained, refused = run_entries(runs, timeout=240)
    assert "validation at iter 2" in check_ok(trained).stdout + trained.stderr
    corpus = tmp_path / "c20" / "corpus.jsonl"
    assert_user_error(refused, f"--split 98,1,1: the valid split of {corpus} is empty: its 20 documents split into "
                               "train 20, valid 0, test 0; give the valid split a larger share")
