"""Chat SFT dataset (loss mask on exactly the assistant tokens, validation, over-long samples) and packing."""
import json
import os
import shutil

import pytest
import torch

import megatron_glm5  # noqa: F401  (shims before megatron.core)
from megatron_glm5.data import TINY_CHAT_TRAIN, TINY_CHAT_VALID
from megatron_glm5.data.jsonl import DataError
from megatron_glm5.data.packing import (collate_padded, concat_packed, first_fit_bins, make_packed_seq_params,
                                       pack_sequences)
from megatron_glm5.data.sft import SFTDataset, tokenize_chat
from megatron_glm5.data.tokenizer import TINY_TOKENIZER_DIR, ChatTemplateError, load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny")


def _write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}

# conversations and, written out by hand, the exact text the assistant generates in each (the mask's target)
CASES = [
    ({"messages": [{"role": "user", "content": "What is 3 plus 4?"},
                   {"role": "assistant", "content": "3 plus 4 is 7."}]},
     ["<think></think>3 plus 4 is 7.<|endoftext|>"]),
    ({"messages": [{"role": "system", "content": "Answer briefly."},
                   {"role": "user", "content": "Spell cat backwards."},
                   {"role": "assistant", "content": "tac", "reasoning_content": "c a t reversed is t a c"},
                   {"role": "user", "content": "Say dog three times."},
                   {"role": "assistant", "content": "dog dog dog"}]},
     ["<think>c a t reversed is t a c</think>tac<|user|>", "<think></think>dog dog dog<|endoftext|>"]),
    ({"messages": [{"role": "user", "content": "What is the weather in Paris?"},
                   {"role": "assistant", "content": "", "tool_calls": [
                       {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                   {"role": "tool", "content": "{\"weather\": \"sunny\"}"},
                   {"role": "assistant", "content": "It is sunny in Paris."}],
      "tools": [WEATHER_TOOL]},
     ["<think></think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"
      "<|observation|>", "<think></think>It is sunny in Paris.<|endoftext|>"]),
    # a trailing user turn: the assistant turn ends with <|user|>, nothing appended
    ({"messages": [{"role": "user", "content": "Count from 1 to 3."},
                   {"role": "assistant", "content": "1 2 3"},
                   {"role": "user", "content": "Thanks."}]},
     ["<think></think>1 2 3<|user|>"]),
]


def _masked_runs(tok, ids, mask):
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


def test_loss_mask_is_exactly_the_assistant_tokens(tmp_path, tok):
    path = _write_jsonl(tmp_path / "chat.jsonl", [c for c, _ in CASES])
    ds = SFTDataset(path, tok, seq_length=256)
    assert len(ds) == len(CASES) and ds.lines == [1, 2, 3, 4]
    assistant = tok.special_ids["<|assistant|>"]
    for k, (case, expected) in enumerate(CASES):
        s = ds[k]
        ids, mask = s["input_ids"].tolist(), s["loss_mask"].tolist()
        assert s["input_ids"].dtype == torch.int64 and s["loss_mask"].dtype == torch.float32
        assert set(mask) <= {0.0, 1.0}
        assert _masked_runs(tok, ids, mask) == expected
        # count check against an independent tokenization of the expected strings
        assert sum(mask) == sum(len(tok.encode(e)) for e in expected)
        # the role token and everything the user/system/tool wrote is not trained
        assert all(m == 0 for i, m in zip(ids, mask) if i == assistant)
        unmasked = tok.decode([i for i, m in zip(ids, mask) if not m])
        for m in case["messages"]:
            if m["role"] != "assistant":
                assert m["content"] in unmasked
        # the sample is the rendered chat (+ eod after a final assistant turn)
        rendered = tok.apply_chat_template(case["messages"], tools=case.get("tools"))
        assert ids[:len(rendered)] == rendered
        assert ids[len(rendered):] == ([tok.eod_id] if case["messages"][-1]["role"] == "assistant" else [])


def test_non_incremental_template_is_rejected(tmp_path, tok):
    # a template that drops earlier reasoning once a later turn exists: renders are not prefixes of each other
    d = tmp_path / "tok"
    shutil.copytree(TINY_TOKENIZER_DIR, d)
    (d / "chat_template.jinja").write_text(
        "[gMASK]<sop>{% for m in messages %}<|{{ m.role }}|>{% if m.role == 'assistant' %}<think>"
        "{% if loop.last %}{{ m.reasoning_content or '' }}{% endif %}</think>{% endif %}{{ m.content }}"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    bad = load_tokenizer(str(d))
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "r"},
            {"role": "user", "content": "c"}]
    with pytest.raises(ChatTemplateError, match="not incremental"):
        tokenize_chat(bad, msgs)
    ids, mask = tokenize_chat(tok, msgs)  # the shipped template is incremental
    assert _masked_runs(tok, ids, mask) == ["<think>r</think>b<|user|>"]


@pytest.mark.parametrize("bad, message", [
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]},
     "messages[1].role 'bot' is not one of system, user, assistant, tool"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
    ({"messages": []}, "'messages' is empty"),
    ({"text": "hi"}, "missing required field 'messages'"),
    ({"messages": [{"role": "user", "content": ["a"]}, {"role": "assistant", "content": "b"}]},
     "messages[0].content (user) must be a string"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]},
     "has no content, reasoning_content or tool_calls"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "tool_calls": [{}]}]},
     "tool_calls[0] needs function.name"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": "{city: Paris}"}}]}]},
     "tool_calls[0].function.arguments is not valid JSON"),
])
def test_bad_records(tmp_path, tok, bad, message):
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    path = _write_jsonl(tmp_path / "c.jsonl", [good, bad, good])
    with pytest.raises(DataError) as e:
        SFTDataset(path, tok, seq_length=64)
    assert str(e.value).startswith(f"{path}:2: ") and message in str(e.value)
    ds = SFTDataset(path, tok, seq_length=64, skip_bad=True)
    assert len(ds) == 2 and ds.stats.skipped_bad == 1 and ds.lines == [1, 3]


def test_skip_counts_and_all_bad(tmp_path, tok):
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    path = _write_jsonl(tmp_path / "c.jsonl", [good, "{nope", {"messages": [{"role": "x", "content": "y"}]}, good])
    ds = SFTDataset(path, tok, seq_length=64, skip_bad=True)
    assert ds.stats.skipped_bad == 2 and ds.stats.reasons == {"malformed_json": 1, "bad_chat": 1}
    allbad = _write_jsonl(tmp_path / "bad.jsonl", ["{nope"])
    with pytest.raises(DataError, match="no valid records"):
        SFTDataset(allbad, tok, seq_length=64, skip_bad=True)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="file is empty"):
        SFTDataset(str(empty), tok, seq_length=64)


def test_overlong_truncate_and_drop(tmp_path, tok):
    short = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}
    long_ = {"messages": [{"role": "user", "content": "Say it."},
                          {"role": "assistant", "content": "cat dog " * 20}]}
    long_prompt = {"messages": [{"role": "user", "content": "cat dog " * 30}, {"role": "assistant", "content": "x"}]}
    path = _write_jsonl(tmp_path / "c.jsonl", [short, long_, short, long_prompt])
    n_short = len(tokenize_chat(tok, short["messages"])[0])
    n_long = len(tokenize_chat(tok, long_["messages"])[0])
    seq = 40
    assert n_short <= seq < n_long - 1 and n_long > 45

    ds = SFTDataset(path, tok, seq_length=seq, overlong="truncate")
    assert len(ds) == 3 and ds.stats.truncated == 1 and ds.stats.dropped_no_target == 1
    assert ds.lines == [1, 2, 3]
    assert len(ds[1]["input_ids"]) == seq + 1  # seq_length + 1: tokens [:-1], labels [1:]
    full_ids, full_mask = tokenize_chat(tok, long_["messages"])
    assert ds[1]["input_ids"].tolist() == full_ids[:seq + 1]
    assert ds[1]["loss_mask"].tolist() == [float(m) for m in full_mask[:seq + 1]]

    packed = SFTDataset(path, tok, seq_length=seq, overlong="truncate", packed=True)
    assert max(len(packed[i]["input_ids"]) for i in range(len(packed))) == seq

    dropped = SFTDataset(path, tok, seq_length=seq, overlong="drop")
    assert len(dropped) == 2 and dropped.stats.dropped_overlong == 2 and dropped.stats.truncated == 0
    assert dropped.lines == [1, 3]
    with pytest.raises(ValueError, match="overlong"):
        SFTDataset(path, tok, seq_length=seq, overlong="wrap")
    with pytest.raises(DataError, match="no usable samples"):
        SFTDataset(_write_jsonl(tmp_path / "l.jsonl", [long_]), tok, seq_length=seq, overlong="drop")


def test_shipped_chat_data(tok):
    valid = SFTDataset(TINY_CHAT_VALID, tok, seq_length=128, overlong="drop")
    assert len(valid) == 200 and valid.stats.skipped_bad == valid.stats.dropped_overlong == 0
    assert max(valid.lengths()) < 128
    assert all(valid[i]["loss_mask"].sum() > 0 for i in range(len(valid)))
    with open(TINY_CHAT_TRAIN, encoding="utf-8") as f:
        train = [json.loads(line) for line in f]
    assert len(train) == 2000
    assert sum(1 for r in train if r.get("tools")) >= 50
    assert sum(1 for r in train if any(m.get("reasoning_content") for m in r["messages"])) >= 200
    assert sum(1 for r in train if r["messages"][0]["role"] == "system") >= 200
    total = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(os.path.dirname(TINY_TOKENIZER_DIR))
                for f in fs)
    assert total < 2 * 1024 * 1024


# ------------------------------------------------------------------------------------------------ packing

def _docs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(20, 500, (n,), generator=g)
        mask = (torch.rand(n, generator=g) > 0.3).float()
        out.append({"input_ids": ids, "loss_mask": mask})
    return out


def _naive_first_fit(lengths, capacity):
    bins, free = [], []
    for i, n in enumerate(lengths):
        for b, room in enumerate(free):
            if n <= room:
                bins[b].append(i)
                free[b] -= n
                break
        else:
            bins.append([i])
            free.append(capacity - n)
    return bins


def test_first_fit():
    assert first_fit_bins([5, 4, 3, 6, 2, 1], 8) == [[0, 2], [1, 4, 5], [3]]
    assert first_fit_bins([], 8) == [] and first_fit_bins([8], 8) == [[0]]
    g = torch.Generator().manual_seed(1)
    for cap in (16, 128):
        lengths = torch.randint(1, cap + 1, (500,), generator=g).tolist()
        assert first_fit_bins(lengths, cap) == _naive_first_fit(lengths, cap)
    with pytest.raises(ValueError, match="more than seq_length"):
        first_fit_bins([3, 9], 8)


def test_pack_sequences(tok):
    seq = 16
    lengths = [5, 4, 3, 6, 2, 1, 16, 7]
    docs = _docs(lengths)
    batches = pack_sequences(docs, seq, pad_id=tok.pad_id)
    assert [b["doc_index"] for b in batches] == first_fit_bins(lengths, seq)
    seen = []
    for b in batches:
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            assert b[key].shape == (1, seq)
        cu = b["cu_seqlens"]
        assert cu.dtype == torch.int32 and int(cu[0]) == 0 and int(cu[-1]) == seq
        used = sum(lengths[i] for i in b["doc_index"])
        n_segments = b["num_docs"] + (1 if used < seq else 0)  # the padding tail is one more segment
        assert cu.numel() == n_segments + 1
        assert b["max_seqlen"] == int((cu[1:] - cu[:-1]).max())
        tokens, labels, lm, pos = b["tokens"][0], b["labels"][0], b["loss_mask"][0], b["position_ids"][0]
        for j, i in enumerate(b["doc_index"]):
            s, e = int(cu[j]), int(cu[j + 1])
            ids, mask = docs[i]["input_ids"], docs[i]["loss_mask"]
            assert e - s == lengths[i]
            assert torch.equal(tokens[s:e], ids)                      # whole document, in place
            assert torch.equal(pos[s:e], torch.arange(e - s))         # positions restart per document
            assert torch.equal(labels[s:e - 1], ids[1:])              # next token of the same document
            assert torch.equal(lm[s:e - 1], mask[1:])                 # target mask shifted onto the labels
            assert lm[e - 1] == 0                                     # no prediction across documents
            seen.append(i)
        if used < seq:  # padding tail
            assert torch.all(tokens[used:] == tok.pad_id) and torch.all(lm[used:] == 0)
            assert torch.equal(pos[used:], torch.arange(seq - used))
    assert sorted(seen) == list(range(len(docs)))  # every document exactly once: all tokens preserved
    assert sum(int(b["tokens"].ne(tok.pad_id).sum()) for b in batches) == sum(lengths)  # ids 20..499: never pad
    again = pack_sequences(_docs(lengths), seq, pad_id=tok.pad_id)  # deterministic
    assert all(torch.equal(x[k], y[k]) for x, y in zip(batches, again) for k in ("tokens", "labels", "loss_mask",
                                                                                  "position_ids", "cu_seqlens"))
    with pytest.raises(ValueError, match="more than seq_length"):
        pack_sequences(_docs([17]), seq, pad_id=0)


def test_concat_packed(tok):
    rows = pack_sequences(_docs([5, 9, 8, 3]), 12, pad_id=tok.pad_id)
    assert len(rows) == 3
    mb = concat_packed(rows)
    assert mb["tokens"].shape == mb["position_ids"].shape == (1, 36)
    assert mb["cu_seqlens"].tolist() == [0, 5, 8, 12, 21, 24, 32, 36]
    assert mb["num_docs"] == 4 and mb["doc_index"] == [0, 3, 1, 2]
    assert torch.equal(mb["labels"][0, 12:24], rows[1]["labels"][0])
    assert make_packed_seq_params(mb["cu_seqlens"], 36).max_seqlen_q == 9


def test_pack_sft_dataset(tok):
    ds = SFTDataset(TINY_CHAT_VALID, tok, seq_length=128, packed=True)
    batches = pack_sequences(ds, 128, pad_id=tok.pad_id)
    assert sum(b["num_docs"] for b in batches) == len(ds)
    assert sum(float(b["loss_mask"].sum()) for b in batches) == sum(float(ds[i]["loss_mask"][1:].sum())
                                                                   for i in range(len(ds)))
    assert len(batches) < len(ds) / 2  # packing actually packs
    params = make_packed_seq_params(batches[0]["cu_seqlens"], 128)
    assert params.qkv_format == "thd"
    assert torch.equal(params.cu_seqlens_q, batches[0]["cu_seqlens"]) and params.cu_seqlens_kv is params.cu_seqlens_q
    assert params.max_seqlen_q == params.max_seqlen_kv == batches[0]["max_seqlen"]
    with pytest.raises(ValueError, match="expected seq_length 64"):
        make_packed_seq_params(batches[0]["cu_seqlens"], 64)


def test_collate_padded(tok):
    docs = _docs([5, 9, 2])
    b = collate_padded(docs, seq_length=8, pad_id=tok.pad_id)
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        assert b[key].shape == (3, 8)
    assert torch.equal(b["position_ids"], torch.arange(8).expand(3, 8))
    for r, d in enumerate(docs):
        n = len(d["input_ids"]) - 1
        assert torch.equal(b["tokens"][r, :n], d["input_ids"][:-1])
        assert torch.equal(b["labels"][r, :n], d["input_ids"][1:])
        assert torch.equal(b["loss_mask"][r, :n], d["loss_mask"][1:])
        assert torch.all(b["loss_mask"][r, n:] == 0) and torch.all(b["tokens"][r, n:] == tok.pad_id)
    assert collate_padded(docs, None, 0)["tokens"].shape == (3, 8)
    with pytest.raises(ValueError, match="more than seq_length"):
        collate_padded(docs, seq_length=7, pad_id=0)
    # plain id lists: every token but the first is a target
    plain = collate_padded([[1, 2, 3]], seq_length=4, pad_id=0)
    assert plain["loss_mask"].tolist() == [[1.0, 1.0, 0.0, 0.0]]


def test_sft_token_cache_reuses_exactly_and_misses_on_any_change(tmp_path, tok, monkeypatch, caplog):
    """data/sft_cache.py: a second dataset of the same file reads its tokens from the cache (tokenizing nothing) and
    equals an uncached one bit for bit at another seq_length; a changed file, chat template or code misses; a file
    with bad lines, max_samples and MEGATRON_GLM5_SFT_CACHE=0 write nothing; a damaged entry is recomputed."""
    from megatron_glm5.data import sft, sft_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(sft_cache.ENV, raising=False)
    cache_dir = tmp_path / "xdg" / "megatron_glm5" / "sft"
    path = _write_jsonl(tmp_path / "chat.jsonl", [case for case, _ in CASES])
    first = SFTDataset(path, tok, seq_length=512)
    entries = sorted(os.listdir(cache_dir))
    assert len(entries) == 1 and entries[0].startswith("chat-") and entries[0].endswith(".npz")

    def no_tokenizing(*a, **k):
        raise AssertionError("tokenized although the cache holds this file")

    with monkeypatch.context() as m:
        m.setattr(sft, "tokenize_chat", no_tokenizing)
        cached = SFTDataset(path, tok, seq_length=20)  # truncation applies to the cached tokens
    monkeypatch.setenv(sft_cache.ENV, "0")
    fresh = SFTDataset(path, tok, seq_length=20)
    monkeypatch.delenv(sft_cache.ENV)
    assert cached.stats == fresh.stats and cached.stats.truncated > 0 and cached.lines == fresh.lines
    for a, b in zip(cached, fresh):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
    assert len(first) == len(CASES) and first.stats.lines == cached.stats.lines == len(CASES)

    # any change misses: the file's bytes, the chat template, the tokenization code
    d = tmp_path / "tok"
    shutil.copytree(TINY_TOKENIZER_DIR, d)
    (d / "chat_template.jinja").write_text((d / "chat_template.jinja").read_text() + "\n")
    keys = {sft_cache.cache_path(path, tok, False, 1 << 20), sft_cache.cache_path(path, load_tokenizer(str(d)),
                                                                                    False, 1 << 20)}
    _write_jsonl(tmp_path / "chat2.jsonl", [case for case, _ in CASES[:1]])
    shutil.copy(tmp_path / "chat2.jsonl", path)  # same name, other content
    keys.add(sft_cache.cache_path(path, tok, False, 1 << 20))
    real_hash = sft_cache._hash_file
    monkeypatch.setattr(sft_cache, "_hash_file",
                        lambda h, f: h.update(b"edited") if f.endswith("sft.py") else real_hash(h, f))
    keys.add(sft_cache.cache_path(path, tok, False, 1 << 20))
    monkeypatch.setattr(sft_cache, "_hash_file", real_hash)
    assert len(keys) == 4
    assert len(SFTDataset(path, tok, seq_length=512)) == 1  # the edited file, not the cached five

    # nothing written for bad lines, max_samples, or the cache off
    shutil.rmtree(cache_dir)
    bad = _write_jsonl(tmp_path / "bad.jsonl", [CASES[0][0], "{not json"])
    assert SFTDataset(bad, tok, seq_length=512, skip_bad=True).stats.skipped_bad == 1
    SFTDataset(path, tok, seq_length=512, max_samples=1)
    monkeypatch.setenv(sft_cache.ENV, "0")
    SFTDataset(path, tok, seq_length=512)
    assert not cache_dir.exists()
    monkeypatch.delenv(sft_cache.ENV)

    # a damaged entry: one warning, tokenized again, rewritten whole
    SFTDataset(path, tok, seq_length=512)
    (entry,) = cache_dir.iterdir()
    entry.write_bytes(b"garbage")
    with caplog.at_level("WARNING"):
        again = SFTDataset(path, tok, seq_length=512)
    assert len(again) == 1 and any("could not be read" in r.getMessage() for r in caplog.records)
    assert sft_cache.load(str(entry)) is not None
