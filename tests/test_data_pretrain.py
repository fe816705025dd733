"""jsonl validation, preprocessing to a Megatron indexed dataset, blended GPTDataset, resumability."""
import collections
import importlib.util
import json
import os

import numpy as np
import pytest
import torch

import megatron_glm5  # noqa: F401  (shims before megatron.core)
from megatron_glm5.data import TINY_PRETRAIN_A, TINY_PRETRAIN_B
from megatron_glm5.data import dataset_helpers, preprocess
from megatron_glm5.data.blend import normalize_blend
from megatron_glm5.data.dataset_helpers import ensure_helpers
from megatron_glm5.data.jsonl import DataError, JsonlStats, iter_jsonl, read_jsonl
from megatron_glm5.data.preprocess import prefix_is_complete, preprocess_jsonl
from megatron_glm5.data.pretrain_datasets import build_pretrain_datasets
from megatron_glm5.data.tokenizer import load_tokenizer
from megatron_glm5.errors import UserError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny")


def _write(path, lines):
    with open(path, "wb") as f:
        for line in lines:
            f.write(line if isinstance(line, bytes) else line.encode("utf-8"))
            f.write(b"\n")
    return str(path)


# ------------------------------------------------------------------------------------------------ jsonl

def test_jsonl_reads_records_with_line_numbers(tmp_path):
    p = _write(tmp_path / "ok.jsonl", ['{"text": "a"}', "", '{"text": "b", "x": 1}'])
    recs, stats = read_jsonl(p, required={"text": str})
    assert recs == [(1, {"text": "a"}), (3, {"text": "b", "x": 1})]
    assert (stats.lines, stats.blank, stats.records, stats.skipped) == (3, 1, 2, 0)


@pytest.mark.parametrize("bad, reason, message", [
    ('{"text": "a",}', "malformed_json", "malformed JSON"),
    (b'{"text": "caf\xe9"}', "invalid_utf8", "not valid UTF-8"),
    ('["text"]', "not_an_object", "expected a JSON object per line, got a list"),
    ('{"body": "a"}', "missing_field", "missing required field 'text' (fields: body)"),
    ('{"text": 3}', "wrong_type", "field 'text' must be a string, got an integer"),
])
def test_jsonl_errors_name_file_and_line(tmp_path, bad, reason, message):
    p = _write(tmp_path / "bad.jsonl", ['{"text": "ok"}', "", bad, '{"text": "fine"}'])
    with pytest.raises(DataError) as e:
        list(iter_jsonl(p, required={"text": str}))
    assert str(e.value).startswith(f"{p}:3: ")
    assert message in str(e.value)
    assert e.value.reason == reason
    assert isinstance(e.value, ValueError) and isinstance(e.value, UserError)
    # skip_bad: counted, not raised
    recs, stats = read_jsonl(p, required={"text": str}, skip_bad=True)
    assert [r[1]["text"] for r in recs] == ["ok", "fine"]
    assert stats.skipped == 1 and stats.reasons == {reason: 1}
    assert stats.errors[0].startswith(f"{p}:3: ")


def test_jsonl_skip_counts_by_reason(tmp_path, caplog):
    p = _write(tmp_path / "mixed.jsonl", ['{"text": "a"}', "{oops", b"\xff\xfe", "42", '{"t": 1}', "{oops2",
                                          '{"text": "b"}'])
    stats = JsonlStats()
    with caplog.at_level("WARNING"):
        recs = list(iter_jsonl(p, required=["text"], skip_bad=True, stats=stats))
    assert [n for n, _ in recs] == [1, 7]
    assert stats.skipped == 5
    assert stats.reasons == {"malformed_json": 2, "invalid_utf8": 1, "not_an_object": 1, "missing_field": 1}
    assert "skipped 5 bad lines" in caplog.text


def test_jsonl_empty_missing_and_all_bad(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match=f"{empty}: file is empty"):
        list(iter_jsonl(empty))
    blank = _write(tmp_path / "blank.jsonl", ["", "   "])
    with pytest.raises(DataError, match=f"{blank}: file is empty"):
        list(iter_jsonl(blank))
    with pytest.raises(DataError, match=f"{tmp_path / 'missing.jsonl'}: no such file"):
        list(iter_jsonl(tmp_path / "missing.jsonl"))
    with pytest.raises(DataError, match="is a directory"):
        list(iter_jsonl(tmp_path))
    allbad = _write(tmp_path / "allbad.jsonl", ["{", "]"])
    with pytest.raises(DataError, match="no valid records: all 2 non-blank lines are bad"):
        list(iter_jsonl(allbad, skip_bad=True))


def test_jsonl_validate_callback(tmp_path):
    p = _write(tmp_path / "v.jsonl", ['{"n": 1}', '{"n": -1}'])

    def positive(rec):
        if rec["n"] < 0:
            raise ValueError("n must be >= 0")

    with pytest.raises(DataError, match=r"v\.jsonl:2: n must be >= 0"):
        read_jsonl(p, validate=positive)


# ------------------------------------------------------------------------------------------------ preprocessing

@pytest.fixture(scope="module")
def prefixes(tmp_path_factory, tok):
    d = tmp_path_factory.mktemp("indexed")
    a = preprocess_jsonl(TINY_PRETRAIN_A, str(d / "a"), tok, append_eod=True, progress=False)
    b = preprocess_jsonl(TINY_PRETRAIN_B, str(d / "b"), tok, append_eod=True, workers=2, progress=False)
    return d, a, b


def _texts(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


@pytest.mark.filterwarnings("ignore:Could not determine rank")
def test_preprocess_writes_indexed_dataset(prefixes, tok):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    d, a, b = prefixes
    texts = _texts(TINY_PRETRAIN_A)
    assert (a.documents, a.lines, a.skipped_bad, a.dtype) == (len(texts), len(texts), 0, "uint16")
    ds = IndexedDataset(a.prefix)
    assert len(ds) == len(texts)
    assert ds.index.dtype == np.uint16  # vocab 512 fits
    for i in (0, 17, len(texts) - 1):
        assert ds[i].tolist() == tok.encode(texts[i]) + [tok.eod_id]
    assert int(ds.sequence_lengths.sum()) == a.tokens
    assert not any(".tmp-" in f for f in os.listdir(d))


def test_preprocess_workers_match_single_process(prefixes, tok, tmp_path):
    d, a, b = prefixes  # b was written with a 2-process pool
    single = preprocess_jsonl(TINY_PRETRAIN_B, str(tmp_path / "b1"), tok, append_eod=True, workers=1, progress=False)
    for ext in (".bin", ".idx"):
        with open(b.prefix + ext, "rb") as f1, open(single.prefix + ext, "rb") as f2:
            assert f1.read() == f2.read()


def test_preprocess_bad_lines(tmp_path, tok):
    p = _write(tmp_path / "in.jsonl", ['{"text": "one"}', '{"txt": "two"}', "{bad", '{"text": ""}',
                                       '{"text": "three"}'])
    with pytest.raises(DataError, match=r"in\.jsonl:2: missing required field 'text'"):
        preprocess_jsonl(p, str(tmp_path / "out"), tok, progress=False)
    assert os.listdir(tmp_path) == ["in.jsonl"]  # nothing left behind
    r = preprocess_jsonl(p, str(tmp_path / "out"), tok, skip_bad=True, append_eod=True, progress=False)
    assert (r.documents, r.skipped_bad, r.empty) == (2, 2, 1)
    # other key
    q = _write(tmp_path / "k.jsonl", ['{"body": "hello"}'])
    r = preprocess_jsonl(q, str(tmp_path / "k"), tok, json_key="body", progress=False)
    assert r.tokens == len(tok.encode("hello"))


def test_preprocess_is_resumable(tmp_path, tok, monkeypatch):
    prefix = str(tmp_path / "out" / "corpus")
    real = preprocess._write_document
    calls = {"n": 0}

    def crash_after_100(builder, ids):
        calls["n"] += 1
        if calls["n"] > 100:
            raise KeyboardInterrupt("simulated kill")
        real(builder, ids)

    monkeypatch.setattr(preprocess, "_write_document", crash_after_100)
    with pytest.raises(KeyboardInterrupt):
        preprocess_jsonl(TINY_PRETRAIN_A, prefix, tok, append_eod=True, progress=False)
    assert not os.path.exists(prefix + ".bin") and not os.path.exists(prefix + ".idx")
    assert os.listdir(tmp_path / "out") == []  # temporary files removed too
    # a run killed hard (no cleanup) leaves temporary files of a dead process: the next run removes them
    stale = prefix + ".tmp-999999999.bin"
    open(stale, "wb").close()
    monkeypatch.setattr(preprocess, "_write_document", real)
    r = preprocess_jsonl(TINY_PRETRAIN_A, prefix, tok, append_eod=True, progress=False)
    assert prefix_is_complete(prefix) and not r.skipped_existing and r.documents == len(_texts(TINY_PRETRAIN_A))
    assert sorted(os.listdir(tmp_path / "out")) == ["corpus.bin", "corpus.idx"]
    mtime = os.path.getmtime(prefix + ".idx")
    again = preprocess_jsonl(TINY_PRETRAIN_A, prefix, tok, append_eod=True, progress=False)
    assert again.skipped_existing and again.documents == 0
    assert os.path.getmtime(prefix + ".idx") == mtime
    redo = preprocess_jsonl(TINY_PRETRAIN_A, prefix, tok, append_eod=False, overwrite=True, progress=False)
    assert not redo.skipped_existing and redo.tokens == r.tokens - r.documents  # no eod this time


def test_cli(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("preprocess_data", os.path.join(REPO, "tools", "preprocess_data.py"))
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    prefix = str(tmp_path / "cli")
    assert cli.main(["--input", TINY_PRETRAIN_B, "--output-prefix", prefix, "--tokenizer", "tiny", "--workers", "1",
                     "--append-eod", "--no-progress"]) == 0
    assert "600 documents" in capsys.readouterr().out
    assert cli.main(["--input", TINY_PRETRAIN_B, "--output-prefix", prefix, "--no-progress"]) == 0
    assert "skipped" in capsys.readouterr().out
    bad = _write(tmp_path / "bad.jsonl", ["{"])
    assert cli.main(["--input", bad, "--output-prefix", str(tmp_path / "x"), "--no-progress"]) == 2
    assert f"error: {bad}:1: malformed JSON" in capsys.readouterr().err
    assert cli.main(["--input", bad, "--output-prefix", str(tmp_path / "x"), "--no-progress",
                     "--skip-bad-lines"]) == 2  # nothing left to write
    assert not os.path.exists(str(tmp_path / "x.bin"))


# ------------------------------------------------------------------------------------------------ datasets

def test_helpers_cpp_available():
    helpers = ensure_helpers()
    assert hasattr(helpers, "build_sample_idx_int32") and hasattr(helpers, "build_blending_indices")


def test_normalize_blend():
    assert normalize_blend("p") == (["p"], None)
    assert normalize_blend(["p", "q"]) == (["p", "q"], None)
    assert normalize_blend([("p", 0.8), ("q", 0.2)]) == (["p", "q"], [0.8, 0.2])
    assert normalize_blend([(3, "p"), (1, "q")]) == (["p", "q"], [3.0, 1.0])
    assert normalize_blend({"p": 1, "q": 2}) == (["p", "q"], [1.0, 2.0])
    assert normalize_blend(["0.8", "p", "0.2", "q"]) == (["p", "q"], [0.8, 0.2])
    assert normalize_blend([("p", 1.0)]) == (["p"], None)
    with pytest.raises(ValueError, match="must be > 0"):
        normalize_blend([("p", 0.0), ("q", 1.0)])


def _check_sample(s, seq_length, eod):
    assert set(s) >= {"tokens", "labels", "loss_mask", "position_ids"}
    assert s["tokens"].shape == s["labels"].shape == s["loss_mask"].shape == s["position_ids"].shape == (seq_length,)
    assert torch.equal(s["tokens"][1:], s["labels"][:-1])  # labels are the next tokens
    assert torch.equal(s["position_ids"], torch.arange(seq_length))


def test_blended_gpt_dataset_honours_weights(prefixes, tok, tmp_path):
    d, a, b = prefixes
    seq = 32
    train, valid, test = build_pretrain_datasets([(a.prefix, 0.8), (b.prefix, 0.2)], "90,5,5", seq_length=seq,
                                                 num_samples=(2000, 100, 100), seed=7, tokenizer=tok,
                                                 cache_dir=str(tmp_path / "cache"))
    assert (len(train), len(valid), len(test)) == (2000, 100, 100)
    counts = collections.Counter(int(train[i]["dataset_id"]) for i in range(len(train)))
    assert abs(counts[0] / len(train) - 0.8) < 0.02 and abs(counts[1] / len(train) - 0.2) < 0.02
    # the samples really come from the two corpora: corpus a is numbers, corpus b is words
    digit_ids = {i for i in range(tok.vocab_size) if tok.decode([i]).strip().isdigit()}
    frac_digits = {k: [] for k in (0, 1)}
    for i in range(200):
        s = train[i]
        _check_sample(s, seq, tok.eod_id)
        frac_digits[int(s["dataset_id"])].append(np.mean([t in digit_ids for t in s["tokens"].tolist()]))
    assert np.mean(frac_digits[0]) > 3 * np.mean(frac_digits[1])
    # same seed -> same order (cached indices), different seed -> different order
    again = build_pretrain_datasets([(a.prefix, 0.8), (b.prefix, 0.2)], "90,5,5", seq_length=seq,
                                    num_samples=(2000, 100, 100), seed=7, tokenizer=tok,
                                    cache_dir=str(tmp_path / "cache"))[0]
    assert all(torch.equal(train[i]["tokens"], again[i]["tokens"]) for i in range(0, 2000, 97))
    swapped = build_pretrain_datasets([(a.prefix, 0.2), (b.prefix, 0.8)], "90,5,5", seq_length=seq,
                                      num_samples=(1000, 10, 10), seed=7, tokenizer=tok,
                                      cache_dir=str(tmp_path / "cache"))[0]
    counts = collections.Counter(int(swapped[i]["dataset_id"]) for i in range(len(swapped)))
    assert abs(counts[1] / len(swapped) - 0.8) < 0.02


def test_single_prefix_gpt_dataset(prefixes, tok, tmp_path):
    from megatron.core.datasets.gpt_dataset import GPTDataset

    d, a, b = prefixes
    train, valid, test = build_pretrain_datasets(a.prefix, "98,2,0", seq_length=64, num_samples=(100, 10, None),
                                                 tokenizer=tok, cache_dir=str(tmp_path / "c"), eod_mask_loss=True,
                                                 reset_position_ids=True)
    assert isinstance(train, GPTDataset) and test is None
    assert len(train) >= 100
    s = train[0]
    toks = s["tokens"]
    assert s["tokens"].shape == (64,)
    # eod_mask_loss: no loss on predicting from the eod token; reset_position_ids: positions restart after eod
    eods = (toks == tok.eod_id).nonzero().flatten().tolist()
    for e in eods:
        assert s["loss_mask"][e] == 0
        if e + 1 < 64:
            assert s["position_ids"][e + 1] == 0


def test_jsonl_files_in_a_blend_are_preprocessed_once(prefixes, tok, tmp_path):
    d, a, b = prefixes
    src = tmp_path / "b.jsonl"
    src.write_bytes(open(TINY_PRETRAIN_B, "rb").read())
    cache = tmp_path / "cache"
    train = build_pretrain_datasets([(a.prefix, 0.5), (str(src), 0.5)], "90,5,5", seq_length=32,
                                    num_samples=(200, 10, 10), tokenizer=tok, cache_dir=str(cache))[0]
    built = sorted(os.listdir(cache / "indexed"))
    assert len(built) == 2 and built[0].startswith("b-") and built[0].endswith(".bin")
    with open(cache / "indexed" / built[0], "rb") as f1, open(b.prefix + ".bin", "rb") as f2:
        assert f1.read() == f2.read()  # same as preprocess_jsonl(..., append_eod=True)
    counts = collections.Counter(int(train[i]["dataset_id"]) for i in range(len(train)))
    assert counts[1] == 100
    mtime = os.path.getmtime(cache / "indexed" / built[1])
    from megatron_glm5.data.index_cache import ensure_indexed

    prefix = ensure_indexed(str(src), tok, cache_dir=str(cache / "indexed"))
    assert prefix_is_complete(prefix) and os.path.getmtime(prefix + ".idx") == mtime  # reused
    assert ensure_indexed(a.prefix, tok) == a.prefix  # prefixes pass through


def test_missing_prefix_is_a_clear_error(tmp_path, tok):
    with pytest.raises(DataError, match="no indexed dataset .*tools/preprocess_data.py"):
        build_pretrain_datasets(str(tmp_path / "nothing"), seq_length=8, num_samples=(1, 1, 1), tokenizer=tok)


@pytest.mark.skipif(importlib.util.find_spec("pybind11") is None, reason="pybind11 not installed (needed to build "
                    "megatron-core's helpers_cpp when the wheel's .so is missing)")
def test_helpers_build_fallback(tmp_path, monkeypatch):
    import megatron.core.datasets as mds

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    module = dataset_helpers._compile_helpers_into_cache(os.path.join(os.path.dirname(mds.__file__), "helpers.cpp"),
                                                         ImportError("test"))
    assert hasattr(module, "build_sample_idx_int32")
