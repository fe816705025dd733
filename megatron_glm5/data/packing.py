"""Micro-batches from variable-length documents: packed (THD, for megatron-core) or padded ([B, S]).

A document is a dict ``{"input_ids": [L], "loss_mask": [L]}`` (what :class:`~megatron_glm5.data.sft.SFTDataset`
gives; ``loss_mask[j] = 1`` when token ``j`` is a training target; missing = every token but the first is a
target) or a plain sequence of token ids.

Packed (:func:`pack_sequences`): whole documents placed greedily first-fit, in the given order, into rows of
``seq_length``; each row is one micro-batch ``tokens``/``labels``/``loss_mask``/``position_ids`` [1, seq_length]
with ``cu_seqlens`` (int32 [n_docs + 1], ``cu_seqlens[-1] == seq_length``; the padding tail, if any, is one more
"document" whose loss_mask is 0).  Position ids restart at 0 in every document, labels are the next token of the
same document, and the last token of each document has loss_mask 0, so nothing is predicted across documents.
Feed ``make_packed_seq_params(batch["cu_seqlens"], seq_length)`` to the model; :func:`concat_packed` joins B
rows into one [1, B * seq_length] micro-batch.

Padded (:func:`collate_padded`): B documents of at most ``seq_length + 1`` tokens -> ``tokens = ids[:-1]``,
``labels = ids[1:]`` padded to [B, seq_length], ``loss_mask`` (0 on padding), ``position_ids = arange``.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

__all__ = ["pack_sequences", "concat_packed", "collate_padded", "make_packed_seq_params", "first_fit_bins"]

Document = Union[Mapping[str, Any], Sequence[int], torch.Tensor]


def _as_doc(doc: Document, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(ids int64 [L], target mask float32 [L]) of a document."""
    if isinstance(doc, Mapping):
        ids = torch.as_tensor(doc["input_ids"], dtype=torch.long).reshape(-1)
        mask = doc.get("loss_mask")
        if mask is None:
            mask = torch.ones_like(ids, dtype=torch.float32)
            mask[:1] = 0
        else:
            mask = torch.as_tensor(mask, dtype=torch.float32).reshape(-1)
    else:
        ids = torch.as_tensor(doc, dtype=torch.long).reshape(-1)
        mask = torch.ones_like(ids, dtype=torch.float32)
        mask[:1] = 0
    if mask.numel() != ids.numel():
        raise ValueError(f"document {index}: loss_mask has {mask.numel()} entries for {ids.numel()} tokens")
    if ids.numel() == 0:
        raise ValueError(f"document {index} is empty")
    return ids, mask


def first_fit_bins(lengths: Sequence[int], capacity: int) -> List[List[int]]:
    """Greedy first-fit: document indices per bin, bins in opening order, documents in input order.

    Each document goes into the first (oldest) bin with room for it, else into a new bin.  A max-tree over the
    bins' free space finds that bin in O(log n), so large datasets pack quickly.
    """
    n_docs = len(lengths)
    size = 1
    while size < max(n_docs, 1):
        size *= 2
    free = [-1] * (2 * size)  # leaves: free space of bin k at size + k (-1: bin not opened); nodes: max of children
    bins: List[List[int]] = []
    for i, n in enumerate(lengths):
        n = int(n)
        if n > capacity:
            raise ValueError(f"document {i} has {n} tokens, more than seq_length {capacity}: truncate or drop it "
                             f"first (SFTDataset(..., packed=True) keeps documents within seq_length)")
        if free[1] >= n:  # some open bin has room: walk down to the leftmost one
            node = 1
            while node < size:
                node = 2 * node if free[2 * node] >= n else 2 * node + 1
            k = node - size
            bins[k].append(i)
        else:
            k = len(bins)
            bins.append([i])
            node = size + k
            free[node] = capacity
        free[node] -= n
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    return bins


def pack_sequences(samples: Iterable[Document], seq_length: int, pad_id: int) -> List[Dict[str, Any]]:
    """Pack documents into THD micro-batches of one row of ``seq_length`` tokens each (see the module doc).

    Returns a list of dicts: ``tokens``, ``labels`` (int64 [1, S]), ``loss_mask`` (float32 [1, S]),
    ``position_ids`` (int64 [1, S]), ``cu_seqlens`` (int32 [n_docs + 1 (+1 with a padding tail)]),
    ``max_seqlen`` (int), ``num_docs`` (documents, without the padding tail), ``doc_index`` (input indices).
    Deterministic: the same input gives the same output.
    """
    docs = [_as_doc(d, i) for i, d in enumerate(samples)]
    bins = first_fit_bins([len(ids) for ids, _ in docs], seq_length)
    out = []
    for members in bins:
        tokens = torch.full((seq_length,), pad_id, dtype=torch.long)
        labels = torch.full((seq_length,), pad_id, dtype=torch.long)
        loss_mask = torch.zeros(seq_length, dtype=torch.float32)
        position_ids = torch.zeros(seq_length, dtype=torch.long)
        cu = [0]
        pos = 0
        for i in members:
            ids, mask = docs[i]
            n = ids.numel()
            tokens[pos:pos + n] = ids
            labels[pos:pos + n - 1] = ids[1:]
            loss_mask[pos:pos + n - 1] = mask[1:]
            position_ids[pos:pos + n] = torch.arange(n)
            pos += n
            cu.append(pos)
        if pos < seq_length:  # the padding tail: its own document, no loss
            position_ids[pos:] = torch.arange(seq_length - pos)
            cu.append(seq_length)
        cu_seqlens = torch.tensor(cu, dtype=torch.int32)
        out.append({
            "tokens": tokens.unsqueeze(0),
            "labels": labels.unsqueeze(0),
            "loss_mask": loss_mask.unsqueeze(0),
            "position_ids": position_ids.unsqueeze(0),
            "cu_seqlens": cu_seqlens,
            "max_seqlen": int((cu_seqlens[1:] - cu_seqlens[:-1]).max()),
            "num_docs": len(members),
            "doc_index": list(members),
        })
    return out


def concat_packed(rows: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """Several packed rows (from :func:`pack_sequences`) as one THD micro-batch: ``tokens`` etc. [1, B * S] and
    ``cu_seqlens`` of all their segments, offset (what megatron-core expects for a micro-batch size B > 1 in THD)."""
    if not rows:
        raise ValueError("concat_packed needs at least one packed row")
    out: Dict[str, Any] = {k: torch.cat([r[k] for r in rows], dim=1)
                           for k in ("tokens", "labels", "loss_mask", "position_ids")}
    cus, offset = [torch.zeros(1, dtype=torch.int32)], 0
    for r in rows:
        cu = r["cu_seqlens"].to(torch.int32)
        cus.append(cu[1:] + offset)
        offset += int(cu[-1])
    out["cu_seqlens"] = torch.cat(cus)
    out["max_seqlen"] = max(int(r["max_seqlen"]) for r in rows)
    out["num_docs"] = sum(int(r["num_docs"]) for r in rows)
    out["doc_index"] = [i for r in rows for i in r["doc_index"]]
    return out


def collate_padded(samples: Sequence[Document], seq_length: Optional[int], pad_id: int) -> Dict[str, torch.Tensor]:
    """A padded micro-batch of B documents: ``tokens``/``labels``/``loss_mask``/``position_ids`` [B, S].

    Each document of L <= S + 1 tokens gives tokens ``ids[:-1]`` and labels ``ids[1:]`` (loss_mask = its target
    mask shifted the same way), right-padded with ``pad_id`` (loss_mask 0).  ``seq_length=None`` pads to the
    longest document in the batch.
    """
    docs = [_as_doc(d, i) for i, d in enumerate(samples)]
    if not docs:
        raise ValueError("collate_padded needs at least one sample")
    longest = max(len(ids) for ids, _ in docs) - 1
    s = longest if seq_length is None else int(seq_length)
    if longest > s:
        raise ValueError(f"a document has {longest + 1} tokens, more than seq_length + 1 = {s + 1}: truncate or drop "
                         f"it first (SFTDataset does)")
    b = len(docs)
    tokens = torch.full((b, s), pad_id, dtype=torch.long)
    labels = torch.full((b, s), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((b, s), dtype=torch.float32)
    for r, (ids, mask) in enumerate(docs):
        n = ids.numel() - 1
        if n <= 0:
            continue
        tokens[r, :n] = ids[:-1]
        labels[r, :n] = ids[1:]
        loss_mask[r, :n] = mask[1:]
    position_ids = torch.arange(s, dtype=torch.long).unsqueeze(0).expand(b, s).contiguous()
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}


def make_packed_seq_params(cu_seqlens: torch.Tensor, seq_length: Optional[int] = None, device=None):
    """megatron-core ``PackedSeqParams(qkv_format="thd")`` for one packed row (``cu_seqlens`` from
    :func:`pack_sequences`; checked to end at ``seq_length`` when given)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.as_tensor(cu_seqlens, dtype=torch.int32).reshape(-1)
    if cu.numel() < 2 or int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must start at 0 and not decrease, got {cu.tolist()}")
    if seq_length is not None and int(cu[-1]) != int(seq_length):
        raise ValueError(f"cu_seqlens ends at {int(cu[-1])}, expected seq_length {seq_length}")
    if device is not None:
        cu = cu.to(device)
    max_seqlen = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_seqlen,
                           max_seqlen_kv=max_seqlen)
