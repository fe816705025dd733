#!/usr/bin/env python
"""Regenerate the shipped tiny assets under ``megatron_glm5/assets/``.

Two deterministic steps (same files byte for byte on every run):

1. data (skipped with ``--tokenizer-only``): ``data/chat_train.jsonl`` / ``data/chat_valid.jsonl`` (SFT chats in
   OpenAI message form: templated arithmetic, spelling, copying, counting, calendar questions, some with a system
   prompt, some with ``reasoning_content``, a few with tool calls) and ``data/pretrain_a.jsonl`` (numbers and
   arithmetic facts) / ``data/pretrain_b.jsonl`` (calendar facts and simple sentences).  All text is generated
   here from small word lists; nothing is copied from elsewhere.
2. tokenizer: a byte-level BPE (HF ``tokenizers``) trained on that data, with GLM-5's special tokens in GLM-5's
   order (``<|endoftext|>`` = 0, ``[MASK]`` = 1, ``[gMASK]`` = 2, ... ``</think>`` = 11, then the tool tokens) and
   ``chat_template.jinja`` (GLM-5's shape, kept in the repository, not generated).  The whole vocabulary,
   added tokens included, is at most 512 ids so that it fits the ``tiny`` model presets.

Usage::

    python tools/build_tiny_tokenizer.py [--out megatron_glm5/assets] [--tokenizer-only] [--vocab-size 512]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
from typing import Dict, Iterator, List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO, "megatron_glm5", "assets")

# GLM-5's special tokens, in GLM-5's id order (154820 ... 154842 in the real vocabulary), then tool-call markup.
SPECIAL_TOKENS = [
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>",
    "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
    "<think>", "</think>", "<tool_call>", "</tool_call>",
    "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>",
]

# ----------------------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------------------

WORDS = (
    "cat dog sun hat red cup pen box fox owl bee cow pig hen ant bus car map egg ice jam key leg mud net nut oak "
    "pot rat sea sky toy van web zoo bird fish frog lamp milk moon nest rain rose ship star tree wolf book cake door "
    "game hand kite leaf bell coat duck farm gold hill lake road sand snow song wind blue green black white apple "
    "bread chair cloud horse house light mouse plant river stone table water"
).split()
NUMBER_WORDS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
                "sixteen seventeen eighteen nineteen twenty").split()
DAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
MONTHS = ("January February March April May June July August September October November December").split()
COLORS = "red blue green yellow black white brown pink".split()
ANIMALS = "cat dog fox owl bee cow pig hen duck frog horse mouse bird fish wolf".split()
PLACES = "park house garden river hill farm road lake".split()
VERBS = "runs walks jumps sits sleeps plays swims looks".split()
CITIES = "Paris Rome Oslo Lima Cairo Tokyo Delhi Quito Bern Riga".split()
WEATHER = "sunny rainy cloudy windy snowy".split()
SYSTEM_PROMPTS = ["You are a helpful assistant.", "Answer briefly.", "You are a friendly tutor.",
                  "Reply with short answers."]
TOOLS = {
    name: {"type": "function", "function": {"name": name, "description": desc,
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
    for name, desc in (("get_weather", "Weather in a city."), ("get_time", "Time in a city."))
}


def _qa(rng: random.Random):
    """One question/answer pair: (question, answer, reasoning or None)."""
    kind = rng.choice(["add", "add", "sub", "reverse", "reverse", "repeat", "repeat", "upper", "count", "day",
                       "month", "next", "first", "bigger", "length", "times"])
    if kind == "add":
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        if rng.random() < 0.5:
            return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}.", f"{a} + {b} = {a + b}"
        return f"Add {a} and {b}.", f"{a + b}", f"{a} + {b} = {a + b}"
    if kind == "sub":
        a = rng.randint(0, 9)
        b = rng.randint(0, a)
        return f"What is {a} minus {b}?", f"{a} minus {b} is {a - b}.", f"{a} - {b} = {a - b}"
    if kind == "times":
        a, b = rng.randint(1, 5), rng.randint(1, 5)
        return f"What is {a} times {b}?", f"{a} times {b} is {a * b}.", f"{a} * {b} = {a * b}"
    if kind == "reverse":
        w = rng.choice(WORDS)
        return f"Spell {w} backwards.", w[::-1], " ".join(w) + " reversed is " + " ".join(w[::-1])
    if kind == "repeat":
        if rng.random() < 0.5:
            ws = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))
            return f"Repeat after me: {ws}", ws, None
        w = rng.choice(WORDS)
        return f"Say {w} three times.", f"{w} {w} {w}", None
    if kind == "upper":
        w = rng.choice(WORDS)
        return f"Write {w} in capital letters.", w.upper(), None
    if kind == "count":
        a = rng.randint(0, 12)
        b = a + rng.randint(1, 5)
        return f"Count from {a} to {b}.", " ".join(str(i) for i in range(a, b + 1)), None
    if kind == "day":
        i = rng.randrange(7)
        if rng.random() < 0.5:
            return f"What day comes after {DAYS[i]}?", f"The day after {DAYS[i]} is {DAYS[(i + 1) % 7]}.", None
        return f"What day comes before {DAYS[i]}?", f"The day before {DAYS[i]} is {DAYS[(i - 1) % 7]}.", None
    if kind == "month":
        i = rng.randrange(12)
        return f"What month comes after {MONTHS[i]}?", f"{MONTHS[(i + 1) % 12]} comes after {MONTHS[i]}.", None
    if kind == "next":
        n = rng.randint(0, 49)
        return f"What number comes after {n}?", f"{n + 1}", f"{n} + 1 = {n + 1}"
    if kind == "first":
        w = rng.choice(WORDS)
        return f"What is the first letter of {w}?", f"The first letter of {w} is {w[0]}.", None
    if kind == "bigger":
        a, b = rng.sample(range(20), 2)
        return (f"Which is bigger, {a} or {b}?", f"{max(a, b)} is bigger.",
                f"{max(a, b)} > {min(a, b)}")
    w = rng.choice(WORDS)
    return f"How many letters are in {w}?", f"{w} has {len(w)} letters.", " ".join(w)


def _tool_chat(rng: random.Random) -> Dict:
    city = rng.choice(CITIES)
    if rng.random() < 0.5:
        weather, temp = rng.choice(WEATHER), rng.randint(-5, 30)
        name, question = "get_weather", f"What is the weather in {city}?"
        result = json.dumps({"weather": weather, "temp": temp})
        answer = f"It is {weather} in {city}, {temp} C."
    else:
        hh, mm = rng.randint(0, 23), rng.choice([0, 15, 30, 45])
        name, question = "get_time", f"What time is it in {city}?"
        result = json.dumps({"time": f"{hh:02d}:{mm:02d}"})
        answer = f"It is {hh:02d}:{mm:02d} in {city}."
    call = {"type": "function", "function": {"name": name, "arguments": {"city": city}}}
    messages = [{"role": "user", "content": question},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": result},
                {"role": "assistant", "content": answer}]
    if rng.random() < 0.3:
        messages[1]["reasoning_content"] = f"I need {name} for {city}."
    return {"messages": messages, "tools": [TOOLS[name]]}


def make_chat(rng: random.Random) -> Dict:
    if rng.random() < 0.06:
        return _tool_chat(rng)
    messages: List[Dict] = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    for _ in range(2 if rng.random() < 0.15 else 1):
        q, a, reasoning = _qa(rng)
        messages.append({"role": "user", "content": q})
        reply = {"role": "assistant", "content": a}
        if reasoning is not None and rng.random() < 0.3:
            reply["reasoning_content"] = reasoning
        messages.append(reply)
    return {"messages": messages}


def make_chats(n_train: int, n_valid: int, seed: int = 0):
    rng = random.Random(seed)
    seen, chats = set(), []
    while len(chats) < n_train + n_valid:
        chat = make_chat(rng)
        key = json.dumps(chat, sort_keys=True)
        if key not in seen:
            seen.add(key)
            chats.append(chat)
    return chats[:n_train], chats[n_train:]


def _number_doc(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        a = rng.randint(0, 10)
        return " ".join(f"{NUMBER_WORDS[a].capitalize()} plus {NUMBER_WORDS[b]} is {NUMBER_WORDS[a + b]}."
                        for b in range(rng.randint(0, 4), min(10, 20 - a) + 1))
    if kind == 1:
        a = rng.randint(1, 9)
        return " ".join(f"{a} times {b} is {a * b}." for b in range(1, 11))
    if kind == 2:
        a = rng.randint(0, 80)
        return "Counting: " + " ".join(str(i) for i in range(a, a + rng.randint(5, 20))) + "."
    a = rng.randint(10, 20)
    return " ".join(f"{a} minus {b} is {a - b}." for b in range(0, rng.randint(3, 10)))


def _word_doc(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        i = rng.randrange(7)
        return (f"Today is {DAYS[i]}. Tomorrow is {DAYS[(i + 1) % 7]}. Yesterday was {DAYS[(i - 1) % 7]}. "
                "A week has seven days.")
    if kind == 1:
        i = rng.randrange(12)
        return f"{MONTHS[i]} comes before {MONTHS[(i + 1) % 12]}. A year has twelve months."
    if kind == 2:
        return " ".join(f"The {rng.choice(COLORS)} {rng.choice(ANIMALS)} {rng.choice(VERBS)} in the "
                        f"{rng.choice(PLACES)}." for _ in range(rng.randint(2, 5)))
    w = rng.choice(WORDS)
    return f"The word {w} has {len(w)} letters. It is spelled {'-'.join(w)}. Backwards it is {w[::-1]}."


def make_pretrain(n: int, doc_fn, seed: int) -> List[Dict]:
    rng = random.Random(seed)
    return [{"text": doc_fn(rng)} for _ in range(n)]


def _write_jsonl(path: str, records: List[Dict]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def write_data(out: str, n_train: int = 2000, n_valid: int = 200, n_pretrain: int = 600) -> None:
    train, valid = make_chats(n_train, n_valid, seed=0)
    data = os.path.join(out, "data")
    _write_jsonl(os.path.join(data, "chat_train.jsonl"), train)
    _write_jsonl(os.path.join(data, "chat_valid.jsonl"), valid)
    _write_jsonl(os.path.join(data, "pretrain_a.jsonl"), make_pretrain(n_pretrain, _number_doc, seed=1))
    _write_jsonl(os.path.join(data, "pretrain_b.jsonl"), make_pretrain(n_pretrain, _word_doc, seed=2))


# ----------------------------------------------------------------------------------------------------------
# tokenizer
# ----------------------------------------------------------------------------------------------------------

def _training_text(out: str) -> Iterator[str]:
    data = os.path.join(out, "data")
    for name in ("chat_train.jsonl", "pretrain_a.jsonl", "pretrain_b.jsonl"):
        with open(os.path.join(data, name), encoding="utf-8") as f:
            for line in f:
                rec = json.loads(line)
                if "text" in rec:
                    yield rec["text"]
                    continue
                # tool chats are rare but long: weight them so that the BPE merges keep them short
                weight = 20 if rec.get("tools") else 1
                for tool in rec.get("tools") or []:
                    yield from [json.dumps(tool, ensure_ascii=False)] * weight
                for m in rec["messages"]:
                    for key in ("content", "reasoning_content"):
                        if m.get(key):
                            yield from [m[key]] * weight
                    for tc in m.get("tool_calls") or []:
                        yield tc["function"]["name"]
                        for k, v in tc["function"]["arguments"].items():
                            yield from [k, v] * weight
    yield from ["# Tools"] * 500  # the tool block header of the chat template


def build_tokenizer(out: str, vocab_size: int = 512) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_training_text(out), trainer)
    assert tok.get_vocab_size(with_added_tokens=True) <= vocab_size, tok.get_vocab_size(with_added_tokens=True)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))

    tdir = os.path.join(out, "tokenizer")
    os.makedirs(tdir, exist_ok=True)
    tok.save(os.path.join(tdir, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "padding_side": "right",
        "additional_special_tokens": SPECIAL_TOKENS[1:],
        "comment": "Tiny test tokenizer for megatron-glm5 (NOT the GLM-5 vocabulary); regenerate with "
                   "tools/build_tiny_tokenizer.py",
    }
    with open(os.path.join(tdir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    if not os.path.exists(os.path.join(tdir, "chat_template.jinja")):
        raise FileNotFoundError(f"{tdir}/chat_template.jinja is missing; it is kept in the repository")
    return tdir


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=DEFAULT_OUT, help="assets directory (default: %(default)s)")
    p.add_argument("--tokenizer-only", action="store_true", help="keep the data files, retrain the tokenizer")
    p.add_argument("--vocab-size", type=int, default=512, help="total vocabulary incl. special tokens")
    args = p.parse_args(argv)
    if not args.tokenizer_only:
        write_data(args.out)
    tdir = build_tokenizer(args.out, args.vocab_size)
    sys.path.insert(0, REPO)
    from megatron_glm5.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tdir)
    print(f"tokenizer: {tdir} (vocab {tok.vocab_size}, eod {tok.eod_id}, pad {tok.pad_id})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
