"""Chat SFT data: jsonl conversations -> token ids + a loss mask on exactly the assistant-generated tokens.

One conversation per line, OpenAI style::

    {"messages": [{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": "What is 3 plus 4?"},
                  {"role": "assistant", "content": "3 plus 4 is 7.", "reasoning_content": "3 + 4 = 7"}],
     "tools": [...optional JSON schemas...]}

Roles: system, user, assistant (optional ``reasoning_content``, optional ``tool_calls`` of
``{"type": "function", "function": {"name": ..., "arguments": {...} or "json"}}``), tool.

The mask is built from the chat template itself, by rendering prefixes: for the i-th message, an assistant turn,
the tokens between ``render(messages[:i], add_generation_prompt=True)`` (which ends with ``<|assistant|>``) and
``render(messages[:i+1])`` are the assistant's: ``<think>reasoning</think>``, content and tool calls.  Each render
must be a token-level prefix of the next, or the template is rejected (:class:`ChatTemplateError`).  The token
that ends the turn is trained too, as GLM-5 learns to stop: the next turn's ``<|user|>`` / ``<|observation|>``
(GLM-5's stop tokens), or an ``<|endoftext|>`` appended after a final assistant turn.  ``<|assistant|>`` itself,
system/user/tool turns and the ``[gMASK]<sop>`` prefix get mask 0.

A sample is ``{"input_ids": int64 [L], "loss_mask": float32 [L]}`` where ``loss_mask[j] = 1`` when token ``j`` is a
training target (it is *aligned with the tokens*; :func:`megatron_glm5.data.packing.pack_sequences` and
:func:`~megatron_glm5.data.packing.collate_padded` shift it onto the labels).  ``L <= seq_length + 1`` (padded
batches: tokens = ids[:-1], labels = ids[1:]), or ``L <= seq_length`` with ``packed=True`` (a packed document uses
one position per token).
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from megatron_glm5.data import sft_cache
from megatron_glm5.data.jsonl import MAX_SAMPLE_BYTES, SKIPPED_SAMPLES, DataError, JsonlStats, iter_jsonl
from megatron_glm5.data.tokenizer import ChatTemplateError, GLM5Tokenizer, load_tokenizer

__all__ = ["SFTDataset", "SFTStats", "validate_chat_record", "tokenize_chat", "ROLES"]

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")


def validate_chat_record(record: Mapping[str, Any]) -> None:
    """Raise :class:`DataError` (reason ``bad_chat``) if ``record`` is not a trainable conversation."""
    def bad(msg: str):
        raise DataError(msg, "bad_chat")

    messages = record.get("messages")
    if messages is None:
        bad(f"missing required field 'messages' (fields: {', '.join(sorted(record)) or 'none'})")
    if not isinstance(messages, list):
        bad(f"'messages' must be a list, got {type(messages).__name__}")
    if not messages:
        bad("'messages' is empty")
    has_assistant = False
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            bad(f"messages[{i}] must be an object, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            bad(f"messages[{i}].role {role!r} is not one of {', '.join(ROLES)}")
        content = m.get("content")
        if role == "assistant":
            has_assistant = True
            calls = m.get("tool_calls")
            if content is not None and not isinstance(content, str):
                bad(f"messages[{i}].content must be a string, got {type(content).__name__}")
            if calls is not None:
                if not isinstance(calls, list):
                    bad(f"messages[{i}].tool_calls must be a list")
                for j, c in enumerate(calls):
                    fn = c.get("function", c) if isinstance(c, dict) else None
                    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                        bad(f"messages[{i}].tool_calls[{j}] needs function.name")
                    args = fn.get("arguments", {})
                    if not isinstance(args, (dict, str)):
                        bad(f"messages[{i}].tool_calls[{j}].function.arguments must be an object or a JSON string")
                    if isinstance(args, str) and args.strip():
                        try:
                            parsed = json.loads(args)
                        except json.JSONDecodeError as e:
                            bad(f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON ({e.msg})")
                        if not isinstance(parsed, dict):
                            bad(f"messages[{i}].tool_calls[{j}].function.arguments must encode an object")
            if not content and not calls and not m.get("reasoning_content"):
                bad(f"messages[{i}] (assistant) has no content, reasoning_content or tool_calls")
            rc = m.get("reasoning_content")
            if rc is not None and not isinstance(rc, str):
                bad(f"messages[{i}].reasoning_content must be a string, got {type(rc).__name__}")
        elif not isinstance(content, str):
            bad(f"messages[{i}].content ({role}) must be a string, got "
                f"{'nothing' if content is None else type(content).__name__}")
    if not has_assistant:
        bad("no assistant message: nothing to train on")
    tools = record.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        bad("'tools' must be a list of objects (JSON schemas)")


def _is_prefix(a: List[int], b: List[int]) -> bool:
    return len(a) <= len(b) and b[:len(a)] == a


def tokenize_chat(tokenizer: GLM5Tokenizer, messages: Sequence[Mapping[str, Any]],
                  tools: Optional[Sequence[Mapping]] = None) -> Tuple[List[int], List[int]]:
    """``(ids, mask)`` for one conversation: ``mask[j] = 1`` on assistant-generated tokens (see module doc).

    Raises :class:`ChatTemplateError` when the template's renders of growing prefixes are not prefixes of each
    other (e.g. a template that drops earlier reasoning once a new user turn arrives).
    """
    stops = set(tokenizer.stop_ids)
    n = len(messages)
    renders: List[List[int]] = [_render(tokenizer, messages[:i], tools) for i in range(n + 1)]
    full = renders[n]
    mask = [0] * len(full)
    for i in range(n):
        if not _is_prefix(renders[i], renders[i + 1]):
            raise ChatTemplateError(
                f"the chat template is not incremental: rendering {i + 1} messages does not extend the render of "
                f"{i} (at token {_first_diff(renders[i], renders[i + 1])}); cannot locate the assistant tokens")
        if messages[i].get("role") != "assistant":
            continue
        head = _render(tokenizer, messages[:i], tools, add_generation_prompt=True)
        if not (_is_prefix(renders[i], head) and _is_prefix(head, renders[i + 1])):
            raise ChatTemplateError(
                f"the chat template's generation prompt for message {i} is not a prefix of the rendered assistant "
                f"turn; cannot locate the assistant tokens")
        start, end = len(head), len(renders[i + 1])
        for j in range(start, end):
            mask[j] = 1
        if i + 1 < n:
            if end < len(full) and full[end] in stops:  # the next turn's <|user|>/<|observation|> ends this one
                mask[end] = 1
        else:
            full = full + [tokenizer.eod_id]
            mask.append(1)
    return full, mask


def _render(tokenizer: GLM5Tokenizer, messages, tools, add_generation_prompt: bool = False) -> List[int]:
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt)
    except ChatTemplateError:
        if messages:
            raise
        return []  # some templates refuse an empty conversation: then the empty prefix renders to nothing


def _first_diff(a: List[int], b: List[int]) -> int:
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return k
    return min(len(a), len(b))


@dataclass
class SFTStats:
    lines: int = 0
    samples: int = 0            # samples kept
    skipped_bad: int = 0        # invalid lines skipped (skip_bad=True)
    truncated: int = 0          # over-long samples cut to the length limit
    dropped_overlong: int = 0   # over-long samples dropped (overlong="drop")
    dropped_no_target: int = 0  # truncation left no assistant token
    reasons: Dict[str, int] = field(default_factory=dict)


class SFTDataset(torch.utils.data.Dataset):
    """Tokenized chat conversations from a jsonl file (see the module doc for the format and the mask).

    ``seq_length``: the model's sequence length.  Samples hold at most ``seq_length + 1`` tokens (``seq_length``
    with ``packed=True``).  ``overlong``: ``"truncate"`` cuts longer samples (counted in ``stats.truncated``;
    a sample whose cut leaves no assistant token is dropped and counted in ``stats.dropped_no_target``) or
    ``"drop"`` drops them (``stats.dropped_overlong``).  ``skip_bad``: count and skip invalid lines
    (``stats.skipped_bad``) instead of raising :class:`DataError` ``file:line: ...``; a line longer than
    ``max_sample_bytes`` is an invalid line, never decoded.
    Each sample also remembers its ``line`` in the file (``self.lines[i]``).
    """

    def __init__(self, path: Union[str, os.PathLike], tokenizer: Union[GLM5Tokenizer, str, None], seq_length: int,
                 skip_bad: bool = False, overlong: str = "truncate", packed: bool = False,
                 max_samples: Optional[int] = None, max_sample_bytes: int = MAX_SAMPLE_BYTES):
        if overlong not in ("truncate", "drop"):
            raise ValueError(f"overlong must be 'truncate' or 'drop', got {overlong!r}")
        if seq_length < 2:
            raise ValueError(f"seq_length must be >= 2, got {seq_length}")
        self.path = os.fspath(path)
        self.tokenizer = load_tokenizer(tokenizer)
        self.seq_length = int(seq_length)
        self.packed = packed
        self.max_tokens = self.seq_length if packed else self.seq_length + 1
        self.overlong = overlong
        self.stats = SFTStats()
        self._ids: List[np.ndarray] = []
        self._mask: List[np.ndarray] = []
        self.lines: List[int] = []

        jstats = JsonlStats()
        cache_file = None if max_samples is not None else sft_cache.cache_path(self.path, self.tokenizer, skip_bad,
                                                                               max_sample_bytes)
        cached = sft_cache.load(cache_file)
        if cached is not None:
            records, jstats.lines = cached
        else:
            records = self._tokenize(skip_bad, max_sample_bytes, jstats)
        kept: sft_cache.Tokenized = []
        for line_no, ids, mask in records:
            if cache_file is not None and cached is None:
                kept.append((line_no, ids, mask))
            if len(ids) > self.max_tokens:
                if overlong == "drop":
                    self.stats.dropped_overlong += 1
                    continue
                ids, mask = ids[:self.max_tokens], mask[:self.max_tokens]
                # the first token is never a target (it has no prediction), so count targets from index 1
                if not any(mask[1:]):
                    self.stats.dropped_no_target += 1
                    continue
                self.stats.truncated += 1
            self._ids.append(np.asarray(ids, dtype=np.int32))
            self._mask.append(np.asarray(mask, dtype=np.uint8))
            self.lines.append(line_no)
            if max_samples is not None and len(self._ids) >= max_samples:
                break
        if cached is None and jstats.skipped == 0:  # a complete pass over a file without bad lines
            sft_cache.save(cache_file, kept, jstats.lines)
        self.stats.lines = jstats.lines
        self.stats.skipped_bad = jstats.skipped
        self.stats.reasons = dict(jstats.reasons)
        self.stats.samples = len(self._ids)
        if not self._ids:
            raise DataError(f"{self.path}: no usable samples (dropped over-long {self.stats.dropped_overlong}, no "
                            f"assistant token after truncation {self.stats.dropped_no_target}, bad lines "
                            f"{self.stats.skipped_bad}) at seq_length {self.seq_length}", "no_records")
        SKIPPED_SAMPLES.add(self.path, {"overlong": self.stats.dropped_overlong,
                                        "no_target_after_truncation": self.stats.dropped_no_target})
        if self.stats.truncated or self.stats.dropped_overlong or self.stats.dropped_no_target:
            logger.warning("%s: %d samples; longer than %d tokens: truncated %d, dropped %d (+%d left without an "
                           "assistant token)", self.path, self.stats.samples, self.max_tokens, self.stats.truncated,
                           self.stats.dropped_overlong, self.stats.dropped_no_target)

    def _tokenize(self, skip_bad: bool, max_sample_bytes: int, jstats: JsonlStats):
        """(line number, ids, mask) of each record of the file, tokenized (the SFT token cache's miss path)."""
        for line_no, record in iter_jsonl(self.path, required={"messages": list}, skip_bad=skip_bad, stats=jstats,
                                          validate=validate_chat_record, max_sample_bytes=max_sample_bytes):
            try:
                ids, mask = tokenize_chat(self.tokenizer, record["messages"], record.get("tools"))
            except ChatTemplateError as e:
                raise ChatTemplateError(f"{self.path}:{line_no}: {e}") from e
            yield line_no, ids, mask

    def __len__(self) -> int:
        return len(self._ids)

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": torch.from_numpy(self._ids[idx].astype(np.int64)),
                "loss_mask": torch.from_numpy(self._mask[idx].astype(np.float32))}

    @property
    def num_tokens(self) -> int:
        return int(sum(len(x) for x in self._ids))

    def lengths(self) -> np.ndarray:
        return np.array([len(x) for x in self._ids], dtype=np.int64)
