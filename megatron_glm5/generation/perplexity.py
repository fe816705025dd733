"""Perplexity of a model on a jsonl file, through the model's plain forward and its training loss.

Each line is ``{"text": "..."}`` (every token is predicted, as in pretraining: the text's tokens and an appended
<|endoftext|>, as tools/preprocess_data.py writes documents) or ``{"messages": [...], "tools": [...]}`` (a chat,
rendered by the tokenizer's chat template; only the assistant's tokens are predicted, exactly the tokens SFT
trains on: data/sft.py's mask). One record per forward, whole (no packing, no truncation): the model's per-token
loss (GPTModel with labels) summed over the predicted tokens. Reported: records, tokens, mean NLL (nats per
predicted token) and ppl = exp(mean NLL).
"""
from __future__ import annotations

import math
from typing import Dict, List, Tuple

import torch

from megatron_glm5.data.jsonl import DataError, iter_jsonl
from megatron_glm5.data.sft import tokenize_chat, validate_chat_record
from megatron_glm5.generation.decode import model_device, model_max_positions


def _validate(record) -> None:
    if "messages" in record:
        validate_chat_record(record)
    elif not isinstance(record.get("text"), str):
        raise ValueError("needs a 'text' string or a 'messages' list")


def eval_samples(path: str, tokenizer) -> List[Tuple[int, List[int], List[int]]]:
    """(line, ids, mask) per record; mask[j] = 1 where token j is predicted (aligned with the tokens)."""
    samples = []
    for line_no, record in iter_jsonl(path, validate=_validate):
        if "messages" in record:
            ids, mask = tokenize_chat(tokenizer, record["messages"], record.get("tools"))
        else:
            ids = tokenizer.encode(record["text"]) + [tokenizer.eod_id]
            mask = [1] * len(ids)
        samples.append((line_no, ids, mask))
    return samples


def _loss(model, tokens: torch.Tensor, stage):
    """The model's per-token NLL [1, n] of ``tokens[:, 1:]``; under a pipeline layout (``stage``) the hidden states
    come from the previous stage and go to the next one, and stages before the last return None."""
    if stage is not None and not model.pre_process:
        model.decoder.set_input_tensor(stage.recv_hidden(tokens.shape[1] - 1, tokens.shape[0]))
    out = model(tokens[:, :-1], labels=tokens[:, 1:])
    if stage is not None and not model.post_process:
        stage.send_hidden(out)
        return None
    return out


@torch.no_grad()
def perplexity(model, tokenizer, path: str, stage=None) -> Dict[str, float]:
    """{"records", "tokens", "nll", "ppl"} of ``model`` (a GLM5Model in eval mode) on ``path``. ``stage``
    (generation/parallel.py): this rank's place in a parallel layout; every rank runs every record, the loss is
    summed on the lead rank (the last pipeline stage; each tensor-parallel rank there holds the same loss, the
    vocabulary-parallel cross entropy having reduced it) and broadcast, so every rank returns the same numbers."""
    max_positions = model_max_positions(model)
    device = model_device(model)
    total, count, used = 0.0, 0, 0
    for line_no, ids, mask in eval_samples(path, tokenizer):
        if max_positions is not None and len(ids) - 1 > max_positions:
            raise DataError(f"{path}:{line_no}: {len(ids)} tokens, more than the model's max_position_embeddings "
                            f"({max_positions}) + 1: split the record", "too_long")
        target_mask = torch.tensor(mask[1:], dtype=torch.float32, device=device)
        if len(ids) < 2 or not bool(target_mask.any()):
            continue
        tokens = torch.tensor(ids, dtype=torch.int64, device=device)[None]
        loss = _loss(model, tokens, stage)
        if loss is not None:
            total += float((loss.float().view(-1) * target_mask).sum())
        count += int(target_mask.sum())
        used += 1
    if count == 0:
        raise DataError(f"{path}: no token to predict (every record is a single token or has no assistant turn)",
                        "no_records")
    if stage is not None:
        total = float(stage.share(torch.tensor([total], dtype=torch.float64) if stage.is_lead else None, (1,),
                                  torch.float64).item())
    nll = total / count
    return {"records": used, "tokens": count, "nll": nll, "ppl": math.exp(nll)}
