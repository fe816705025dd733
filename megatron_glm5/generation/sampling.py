"""Choosing the next token: greedy, or sampled with temperature, top-k and top-p (nucleus); and the stop tokens.

Sampling draws from one ``torch.Generator`` seeded by ``seed``: the same seed, prompts and model give the same
tokens. The filters apply in the usual order: logits / temperature, keep the ``top_k`` largest, keep the
smallest set of most likely tokens whose probability reaches ``top_p`` (the most likely token always stays).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional

import torch

from megatron_glm5.errors import UserError


class SamplingError(UserError, ValueError):
    """A sampling setting out of range."""


@dataclass(frozen=True)
class SamplingParams:
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no nucleus filter
    seed: Optional[int] = None  # None: a random seed (printed by tools/generate.py)

    def __post_init__(self):
        if not self.temperature >= 0:
            raise SamplingError(f"--temperature {self.temperature}: must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"--top-p {self.top_p}: must be in (0, 1] (1 keeps every token)")
        if self.top_k < 0:
            raise SamplingError(f"--top-k {self.top_k}: must be >= 0 (0 keeps every token)")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0 or self.top_k == 1


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits [b, V] with every token outside the top-k / top-p set at -inf (fp32)."""
    logits = logits.float()
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # probability of the more likely tokens
        drop_sorted = before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class Sampler:
    """next token ids [b] from last-position logits [b, V]."""

    def __init__(self, params: SamplingParams, device="cpu"):
        self.params = params
        # without a seed: the OS's entropy (torch's generator is seeded by the parallel set-up, platform.py)
        self.seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little") % (2 ** 31 - 1)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(self.seed)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        if p.is_greedy:
            return logits.float().argmax(dim=-1)
        scaled = filter_logits(logits.float() / p.temperature, p.top_k, p.top_p)
        probs = torch.softmax(scaled, dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)


def stop_token_ids(eos_token_id, tokenizer=None) -> List[int]:
    """The ids that end generation: the model config's ``eos_token_id`` (an int or a list; GLM-5: <|endoftext|>,
    <|user|>, <|observation|>) and the tokenizer's stop tokens (its end of text and GLM-5's chat-turn ends)."""
    ids = []
    if eos_token_id is not None:
        ids.extend([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
    if tokenizer is not None:
        ids.extend(tokenizer.stop_ids)
    return sorted(set(int(i) for i in ids))
