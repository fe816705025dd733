"""Prefill and incremental decoding through the model's own modules, with the GLM-5 cache (kv_cache.py).

``cached_forward`` runs the model's embedding, decoder block and output layer (GPTModel.forward's path without MTP;
under a pipeline layout the part of them on this rank's stage, generation/parallel.py) on some tokens at given positions, with a ``CachedInputs`` in place of the per-forward
AttentionInputs: every MLA layer writes its new ``[latent | k_rope]`` rows into the cache and attends from its new
queries over the cached rows of its batch row; every full-indexer layer writes its new indexer keys and selects
each new query's top-k (min(index_topk, position + 1) keys) over the cached ones; IndexShare layers reuse the top-k
their source layer left in this forward's store. Nothing of the math is re-implemented here.

``generate``: prefill (each prompt whole, right-padded into one batch), then one token per row per step until a
stop token, ``max_new_tokens`` or the model's ``max_position_embeddings``; under a parallel layout every rank
runs the same steps and the lead rank's tokens are broadcast.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import torch

from megatron_glm5.errors import UserError
from megatron_glm5.generation.kv_cache import KVCache, cached_inputs
from megatron_glm5.generation.sampling import Sampler, SamplingParams


class PromptError(UserError, ValueError):
    """A prompt that cannot be generated from (empty, or longer than the model's positions)."""


@torch.no_grad()
def cached_forward(model, cache: KVCache, input_ids: torch.Tensor, position_ids: torch.Tensor,
                   last: Optional[torch.Tensor] = None, stage=None) -> Optional[torch.Tensor]:
    """Logits [b, s, V] of ``input_ids`` [b, s] at ``position_ids`` [b, s], their keys written into ``cache``.
    ``last`` [b]: only the logits at index ``last[i]`` of each row ([b, 1, V]; prefill of right-padded prompts).
    ``stage`` (generation/parallel.py's Stage; None: the whole model in this process): a pipeline stage after
    the first takes its hidden states from the previous stage, one before the last hands them on and returns
    None; with tensor parallelism the logits are gathered over the vocabulary."""
    cfg = model.config
    inputs = cached_inputs(cache, position_ids, cfg.qk_pos_emb_head_dim, cfg.rotary_base)
    if model.pre_process:
        hidden = model.embedding(input_ids=input_ids, position_ids=position_ids)
    else:
        model.decoder.set_input_tensor(stage.recv_hidden(input_ids.shape[1], input_ids.shape[0]))
        hidden = None
    hidden = model.decoder(hidden_states=hidden, attention_mask=None, rotary_pos_emb=inputs)  # [s, b, H]
    if not model.post_process:
        stage.send_hidden(hidden)
        return None
    if last is not None:
        hidden = hidden[last.to(hidden.device), torch.arange(hidden.shape[1], device=hidden.device)].unsqueeze(0)
    logits, _ = model.output_layer(hidden, runtime_gather_output=True)  # the whole vocabulary
    return logits.transpose(0, 1)


@dataclass
class Generation:
    prompt: List[int]
    tokens: List[int] = field(default_factory=list)  # generated ids (the stop token included when one ended it)
    finish_reason: str = "length"  # "stop" (a stop token), "length" (max_new_tokens or max positions)


def model_max_positions(model) -> Optional[int]:
    """max_position_embeddings of a model loaded by megatron_glm5.api (its ``glm5_config``); None when unknown."""
    cfg = getattr(model, "glm5_config", None)
    return None if cfg is None else int(cfg.max_position_embeddings)


def check_prompts(prompts: Sequence[Sequence[int]], max_positions: Optional[int]) -> None:
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise PromptError(f"prompt {i + 1} is empty (no tokens): give it some text")
        if max_positions is not None and len(p) >= max_positions:
            raise PromptError(f"prompt {i + 1} has {len(p)} tokens, the model's max_position_embeddings is "
                              f"{max_positions}: shorten it to at most {max_positions - 1} tokens")


def model_device(model) -> torch.device:
    """Where a model (or one pipeline stage of it) lives."""
    return next(model.parameters()).device


@torch.no_grad()
def generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
             stop_ids: Sequence[int] = (), sampler: Optional[Sampler] = None, stage=None,
             on_logits: Optional[Callable[[torch.Tensor], None]] = None) -> List[Generation]:
    """Generate from each prompt (token ids); all rows decode together, a row that ended is carried along.

    ``stage``: this rank's place in a parallel layout (generation/parallel.py; None: one process). Every rank runs
    the same batch; the lead rank alone samples (its ``sampler``) and broadcasts the tokens. ``on_logits``: called
    on the sampling rank with each step's logits [b, V] (prefill's last position first), before sampling."""
    max_positions = model_max_positions(model)
    check_prompts(prompts, max_positions)
    if max_new_tokens < 1:
        raise PromptError(f"--max-new-tokens {max_new_tokens}: must be >= 1")
    device = model_device(model)
    samples = stage is None or stage.is_lead
    b = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int64, device=device)
    # positions each row may fill: prompt + max_new_tokens, at most the model's positions
    limit = lengths + max_new_tokens if max_positions is None else torch.clamp(lengths + max_new_tokens,
                                                                               max=max_positions)
    cache = KVCache.for_model(model, b, int(limit.max()))
    if samples and sampler is None:
        sampler = Sampler(sampling, device=device)
    stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.int64, device=device)

    def next_token(logits):
        token = None
        if samples:
            if on_logits is not None:
                on_logits(logits)
            token = sampler(logits)
        return token if stage is None else stage.share(token, (b,), torch.int64)

    width = int(lengths.max())
    ids = torch.zeros(b, width, dtype=torch.int64, device=device)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(list(p), dtype=torch.int64)
    positions = torch.arange(width, device=device).expand(b, width)
    logits = cached_forward(model, cache, ids, positions, last=lengths - 1, stage=stage)

    out = [Generation(prompt=list(p)) for p in prompts]
    done = torch.zeros(b, dtype=torch.bool, device=device)
    pos = lengths.clone()  # where each row's next token goes
    while True:
        token = next_token(None if logits is None else logits[:, -1])
        for i in torch.nonzero(~done).flatten().tolist():
            out[i].tokens.append(int(token[i]))
        stopped = torch.isin(token, stops) & ~done
        for i in torch.nonzero(stopped).flatten().tolist():
            out[i].finish_reason = "stop"
        done |= stopped | (pos + 1 >= limit)  # the next token would be past max_new_tokens or max positions
        if bool(done.all()):
            return out
        # a finished row keeps re-writing its last slot (nothing reads it again); the others advance
        step_pos = torch.where(done, torch.clamp(pos, max=cache.max_len - 1), pos)
        logits = cached_forward(model, cache, token[:, None], step_pos[:, None], stage=stage)
        pos = torch.where(done, pos, pos + 1)
