"""Tokenizer wrapper: the shipped tiny tokenizer, GLM-5 chat format, sentencepiece, errors."""
import io
import json
import os
import pickle
import shutil

import pytest

import megatron_glm5  # noqa: F401  (shims before megatron.core)
from megatron_glm5.data.tokenizer import (DEFAULT_CHAT_TEMPLATE_PATH, GLM_SPECIAL_TOKENS, TINY_TOKENIZER_DIR,
                                          ChatTemplateError, GLM5Tokenizer, TokenizerNotFoundError, load_tokenizer)

GLM5_ORDER = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
              "<|assistant|>", "<|observation|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny")


def test_tiny_vocab_and_special_ids(tok):
    assert isinstance(tok, GLM5Tokenizer)
    assert load_tokenizer(None).vocab_size == tok.vocab_size
    assert tok.vocab_size <= 512  # fits the tiny model presets
    # GLM-5's special tokens in GLM-5's relative order (154820, 154821, ...)
    assert [tok.special_ids[t] for t in GLM5_ORDER] == list(range(len(GLM5_ORDER)))
    assert tok.eod_id == tok.special_ids["<|endoftext|>"] == 0
    assert tok.pad_id == tok.eod_id  # GLM: pad token is <|endoftext|>
    assert tok.stop_ids == [tok.special_ids[t] for t in ("<|endoftext|>", "<|user|>", "<|observation|>")]
    assert tok.token_to_id("<think>") == 10 and tok.id_to_token(11) == "</think>"
    for t in GLM_SPECIAL_TOKENS:
        assert tok.encode(t) == [tok.special_ids[t]], t  # every control token is one id


@pytest.mark.parametrize("text", ["What is 3 plus 4? 3 plus 4 is 7.", "Spell cat backwards.\n  tac\t!",
                                  "héllo wörld — 你好，世界 🙂", "", "x" * 300,
                                  "[gMASK]<sop><|user|>hi<|assistant|><think></think>yo<|endoftext|>"])
def test_roundtrip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_encode_does_not_add_specials(tok):
    ids = tok.encode("hello")
    assert tok.eod_id not in ids and tok.special_ids["[gMASK]"] not in ids
    assert tok.decode(tok.encode("a<|user|>b"), skip_special_tokens=True) == "ab"


CHAT = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 3 plus 4?"},
    {"role": "assistant", "content": "3 plus 4 is 7.", "reasoning_content": "3 + 4 = 7"},
    {"role": "user", "content": "Spell cat backwards."},
    {"role": "assistant", "content": "tac"},
]


def test_chat_template_shape(tok):
    text = tok.render_chat(CHAT)
    assert text == ("[gMASK]<sop><|system|>Answer briefly.<|user|>What is 3 plus 4?<|assistant|><think>3 + 4 = 7"
                    "</think>3 plus 4 is 7.<|user|>Spell cat backwards.<|assistant|><think></think>tac")
    for role in ROLE_TOKENS:  # no newline after role tokens
        assert role + "\n" not in text
    prompt = tok.render_chat(CHAT[:2], add_generation_prompt=True)
    assert prompt.endswith("<|user|>What is 3 plus 4?<|assistant|>")
    assert tok.render_chat(CHAT[:2], add_generation_prompt=True, enable_thinking=False).endswith(
        "<|assistant|><think></think>")
    ids = tok.apply_chat_template(CHAT)
    assert ids == tok.encode(text)
    assert ids[:3] == [tok.special_ids["[gMASK]"], tok.special_ids["<sop>"], tok.special_ids["<|system|>"]]
    a = tok.special_ids["<|assistant|>"]
    for k in [k for k, i in enumerate(ids) if i == a]:  # every assistant turn opens a think block
        assert ids[k + 1] == tok.special_ids["<think>"]


def test_chat_template_tools(tok):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    chat = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}}]},
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "rainy"},
        {"role": "assistant", "content": "Sunny in Paris, rainy in Rome."},
    ]
    text = tok.render_chat(chat, tools=tools)
    assert text.startswith("[gMASK]<sop><|system|># Tools\n" + json.dumps(tools[0]) + "<|user|>")
    assert ("<|assistant|><think></think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
            "</tool_call><tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value><arg_key>days"
            "</arg_key><arg_value>2</arg_value></tool_call>") in text
    # consecutive tool results share one observation turn
    assert "<|observation|><tool_response>sunny</tool_response><tool_response>rainy</tool_response><|assistant|>" in text
    assert text.count("<|observation|>") == 1
    with pytest.raises(ChatTemplateError, match="Unknown chat role"):
        tok.render_chat([{"role": "robot", "content": "x"}])


def test_pickle_reloads(tok):
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.encode("Count from 3 to 7.") == tok.encode("Count from 3 to 7.")
    assert clone.vocab_size == tok.vocab_size


def test_hf_directory_and_missing_template(tmp_path, caplog):
    d = tmp_path / "tok"
    shutil.copytree(TINY_TOKENIZER_DIR, d)
    t = load_tokenizer(str(d))
    assert t.vocab_size == load_tokenizer("tiny").vocab_size
    os.remove(d / "chat_template.jinja")
    t = load_tokenizer(str(d))  # falls back to the GLM-shaped default
    with open(DEFAULT_CHAT_TEMPLATE_PATH) as f:
        assert t.chat_template == f.read()
    assert t.render_chat(CHAT[1:3]).startswith("[gMASK]<sop><|user|>")


def test_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(TokenizerNotFoundError, match=str(missing)):
        load_tokenizer(str(missing))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TokenizerNotFoundError, match=r"lacks tokenizer\.json, tokenizer_config\.json") as e:
        load_tokenizer(str(empty))
    assert str(empty) in str(e.value)
    half = tmp_path / "half"
    half.mkdir()
    shutil.copy(os.path.join(TINY_TOKENIZER_DIR, "tokenizer.json"), half)
    with pytest.raises(TokenizerNotFoundError, match=r"lacks tokenizer_config\.json") as e:
        load_tokenizer(str(half))
    assert str(half) in str(e.value)
    assert isinstance(e.value, FileNotFoundError)
    other = tmp_path / "notes.txt"
    other.write_text("hi")
    with pytest.raises(TokenizerNotFoundError, match="not a sentencepiece"):
        load_tokenizer(str(other))


def _train_sentencepiece(path):
    import sentencepiece as spm

    lines = ["The quick brown fox jumps over the lazy dog.", "What is 3 plus 4? 3 plus 4 is 7.",
             "Spell cat backwards: tac.", "Monday Tuesday Wednesday Thursday Friday Saturday Sunday",
             "Count from 1 to 5: 1 2 3 4 5."] * 20
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, vocab_size=150,
                                   model_type="bpe", user_defined_symbols=list(GLM_SPECIAL_TOKENS),
                                   character_coverage=1.0, hard_vocab_limit=False, minloglevel=2)
    with open(path, "wb") as f:
        f.write(buf.getvalue())


def test_sentencepiece_model(tmp_path):
    model = tmp_path / "sp.model"
    _train_sentencepiece(model)
    t = load_tokenizer(str(model))
    assert t.backend == "sentencepiece"
    assert t.vocab_size <= 150
    assert t.eod_id == t.special_ids["<|endoftext|>"]
    for s in GLM5_ORDER:
        assert t.encode(s) == [t.special_ids[s]]
    text = "What is 3 plus 4? Count from 1 to 5."
    assert t.decode(t.encode(text)) == text
    chat = [{"role": "user", "content": "What is 3 plus 4?"},
            {"role": "assistant", "content": "7", "reasoning_content": "3 plus 4"}]
    ids = t.apply_chat_template(chat)
    assert t.decode(ids) == "[gMASK]<sop><|user|>What is 3 plus 4?<|assistant|><think>3 plus 4</think>7"
    assert ids[:3] == [t.special_ids["[gMASK]"], t.special_ids["<sop>"], t.special_ids["<|user|>"]]
    assert pickle.loads(pickle.dumps(t)).encode(text) == t.encode(text)
    # a directory holding tokenizer.model is a sentencepiece tokenizer too
    d = tmp_path / "spdir"
    d.mkdir()
    shutil.copy(model, d / "tokenizer.model")
    assert load_tokenizer(str(d)).encode(text) == t.encode(text)
