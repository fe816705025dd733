"""The host-known planning of a training step (no host-GPU synchronisation) gives the old answers.

- token_windows builds the windows on the host: the values written out here by hand (batches, packed documents,
  a one-token sequence, context parallelism), and ops/host_windows.py hands the planner the host copy of a
  device tensor (while it is alive and unmodified).
- reference.windows planned from that host copy gives the same chunk spans and window sizes as from the tensor.
- the MoE layer's device-count dispatcher (one EP/TP rank): the same loss and gradients, bitwise, as megatron-core's
  dispatcher, without its device -> host copies of the counts.
"""
import pytest
import torch

from megatron_glm5.model.attention_inputs import token_windows
from megatron_glm5.ops import host_windows, reference


def _expected(batch, seq, docs=None, cp=1, rank=0):
    """By hand: every token's own sequence (or document) start; query_end its own row; local rows under CP."""
    starts, ends = [], []
    for b in range(batch):
        bounds = docs if docs is not None else [0, seq]
        for p in range(seq):
            d = max(i for i in range(len(bounds) - 1) if bounds[i] <= p)
            starts.append(b * seq + bounds[d])
            ends.append(b * seq + p)
    max_window = max(e - s + 1 for s, e in zip(starts, ends))
    if cp == 1:
        return starts, ends, max_window
    chunk = seq // (2 * cp)
    pos = list(range(rank * chunk, (rank + 1) * chunk)) + list(range((2 * cp - 1 - rank) * chunk,
                                                                     (2 * cp - rank) * chunk))
    rows = [b * seq + p for b in range(batch) for p in pos]
    return [starts[r] for r in rows], rows, max_window


@pytest.mark.parametrize("batch,seq,docs,cp,rank", [
    (2, 8, None, 1, 0), (1, 1, None, 1, 0), (1, 10, [0, 3, 4, 10], 1, 0), (1, 8, [0, 5, 8], 2, 1),
    (2, 8, None, 2, 0), (1, 7, [0, 7], 1, 0),
])
def test_token_windows_built_on_the_host(batch, seq, docs, cp, rank):
    cu = None if docs is None else torch.tensor(docs, dtype=torch.int32)
    ks, qe, mw = token_windows(batch, seq, cu, cp, rank)
    want_ks, want_qe, want_mw = _expected(batch, seq, docs, cp, rank)
    assert ks.tolist() == want_ks and qe.tolist() == want_qe and mw == want_mw
    assert ks.dtype == qe.dtype == torch.int64 and ks.device.type == "cpu"


def test_host_copy_of_a_device_tensor_and_the_planning_from_it():
    ks_host = torch.tensor([0, 0, 0, 3, 3, 5, 5, 5, 5, 9])
    qe_host = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 4, 9])  # row 8: an empty window (qe < ks)
    ks_dev, qe_dev = host_windows.to_device(ks_host, "meta"), host_windows.to_device(qe_host, "meta")
    assert ks_dev.device.type == "meta"
    assert host_windows.host_copy(ks_dev) is ks_host and host_windows.host_copy(qe_dev) is qe_host
    cpu_t = torch.zeros(3)
    assert host_windows.host_copy(cpu_t) is cpu_t and host_windows.host_copy(None) is None
    planned = reference.windows(ks_dev, qe_dev, 10, 10)  # meta tensors hold no values: planned from the host copies
    direct = reference._Windows(ks_host.clone(), qe_host.clone(), 10, 10)
    assert planned.n_valid.tolist() == direct.n_valid.tolist() == [1, 2, 3, 1, 2, 1, 2, 3, 0, 1]
    for c0 in range(10):
        for c1 in range(c0 + 1, 11):
            assert planned.span(c0, c1) == direct.span(c0, c1)
    assert planned.span(8, 9) == (10, -1)  # an empty row widens nothing
    ks_dev.add_(1)  # modified in place: the host copy no longer holds its values
    assert host_windows.host_copy(ks_dev) is ks_dev


def test_the_indexer_leaves_its_row_bounds_for_the_sparse_backward():
    """chunked_topk remembers each row's last window key (-1: empty window) under the top-k tensor it returns, as
    long as that tensor is unmodified; an equal but different tensor has none."""
    from megatron_glm5.ops.triton_indexer import chunked_topk

    ks = torch.tensor([0, 0, 0, 3, 3, 5, 5, 5, 5, 9])
    qe = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 4, 9])  # row 8 empty

    def score_keys(c0, rows, lo, width, ks_, qe_, keys):  # any values: only the bounds are checked here
        keys.copy_(torch.arange(width, dtype=torch.int64).expand(rows, width))

    q, k, w = torch.zeros(10, 2, 4), torch.zeros(10, 4), torch.zeros(10, 2)
    out = chunked_topk(q, k, w, 4, ks, qe, score_keys)
    assert host_windows.row_ends(out).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, -1, 9]
    assert host_windows.row_ends(out.clone()) is None
    out[0, 0] = 1  # modified: the bounds may no longer hold
    assert host_windows.row_ends(out) is None


def test_the_indexer_leaves_the_log_sum_exp_of_each_rows_selected_scores():
    """Given the scale, chunked_topk remembers under its result the LSE of each row's selected scores (decoded
    from the sortable keys; -inf for a row without keys), for those very inputs only."""
    from megatron_glm5.ops.triton_indexer import chunked_topk

    ks = torch.tensor([0, 0, 0, 3, 3, 5, 5, 5, 5, 9])
    qe = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 4, 9])  # row 8 empty
    scores = torch.tensor([[-3.5, 0.0, -0.0, 2.25, 7.0, -1e30, 1e-30, 5.5, -7.75, 1.0]]).expand(10, 10)

    def score_keys(c0, rows, lo, width, ks_, qe_, keys):  # the scoring kernels' encoding of these scores
        bits = scores[c0:c0 + rows, lo:lo + width].contiguous().view(torch.int32)
        rel = torch.arange(width, dtype=torch.int64)
        j = lo + rel
        inside = (j >= ks_[c0:c0 + rows, None]) & (j <= qe_[c0:c0 + rows, None])
        bits = torch.where(inside, bits, torch.tensor(float("-inf")).view(torch.int32))
        ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.int64)
        keys.copy_(ordered * 4294967296 + (4294967295 - rel))

    q, k, w = torch.zeros(10, 2, 4), torch.zeros(10, 4), torch.zeros(10, 2)
    out = chunked_topk(q, k, w, 3, ks, qe, score_keys, softmax_scale=0.5)
    lse = host_windows.selected_lse(out, q, k, w, 0.5)
    s64 = scores[0].double()
    want = [float(torch.logsumexp(s64[int(ks[t]):int(qe[t]) + 1].topk(min(3, int(qe[t] - ks[t]) + 1)).values, 0))
            if qe[t] >= ks[t] else float("-inf") for t in range(10)]
    assert lse.dtype == torch.float32
    torch.testing.assert_close(lse.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=1e-6)
    assert host_windows.selected_lse(out, q, k, w, 0.25) is None  # another scale
    assert host_windows.selected_lse(out, q.clone(), k, w, 0.5) is None  # other inputs
    assert host_windows.selected_lse(out.clone(), q, k, w, 0.5) is None
    assert host_windows.selected_lse(chunked_topk(q, k, w, 3, ks, qe, score_keys), q, k, w, 0.5) is None  # no scale
    w.add_(0)  # modified in place
    assert host_windows.selected_lse(out, q, k, w, 0.5) is None


def _tiny_moe_run(monkeypatch, device_counts: bool):
    import megatron_glm5
    from megatron.core.transformer.moe import token_dispatcher
    from megatron_glm5 import GLM5Config, build_model
    from megatron_glm5.mcore_patches.registry import DISABLE_ENV

    if not device_counts:  # the patch switched off the way every megatron-core patch can be
        monkeypatch.setenv(DISABLE_ENV, "moe_device_counts")
    copies = []  # calls of megatron-core's device -> host copy / wait of the counts
    base = token_dispatcher.MoEAlltoAllTokenDispatcher
    dtoh = base._maybe_dtoh_and_synchronize
    monkeypatch.setattr(base, "_maybe_dtoh_and_synchronize",
                        lambda self, *a, **k: (copies.append(1), dtoh(self, *a, **k))[1])
    megatron_glm5.initialize_model_parallel(seed=3)
    cfg = GLM5Config.from_preset("tiny").replace(num_hidden_layers=2)
    model = build_model(cfg, mtp=False, moe_token_dispatcher_type="alltoall", moe_triton_permute_fusion=False)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(5))
    loss = model(ids).float().pow(2).mean()
    loss.backward()
    monkeypatch.undo()
    return (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            type(model.decoder.layers[1].mlp.token_dispatcher).__name__, len(copies))


def test_moe_device_counts_same_loss_and_gradients(monkeypatch):
    loss0, grads0, name0, copies0 = _tiny_moe_run(monkeypatch, device_counts=False)
    loss1, grads1, name1, copies1 = _tiny_moe_run(monkeypatch, device_counts=True)
    assert name0 == "MoEAlltoAllTokenDispatcher" and name1 == "MoEAlltoAllTokenDispatcherDeviceCounts"
    assert copies0 > 0 and copies1 == 0  # megatron-core's copies the counts to the host; ours never
    assert torch.equal(loss0, loss1)
    assert grads0.keys() == grads1.keys() and any("experts" in n for n in grads1)
    for n in grads0:
        assert torch.equal(grads0[n], grads1[n]), n


def test_window_check_ignores_empty_rows_and_rejects_keys_outside():
    """The window plan's range check (on its lo / hi rows, without boolean indexing): rows with query_end <
    key_start are empty and may hold any values; a non-empty window outside [0, n_keys) is an error."""
    w = reference._Windows(torch.tensor([0, 50, 2]), torch.tensor([3, -7, 9]), 3, 10)
    assert w.n_valid.tolist() == [4, 0, 8] and w.row_hi.tolist() == [3, -1, 9]
    assert w.span(0, 3) == (0, 9) and w.span(1, 2) == (10, -1)  # an empty row does not widen a span
    for ks, qe in (([0, -1], [3, 4]), ([0, 2], [3, 10])):
        with pytest.raises(ValueError, match="must lie inside the 10 key rows"):
            reference._Windows(torch.tensor(ks), torch.tensor(qe), 2, 10)
    none = torch.tensor([], dtype=torch.int64)
    assert reference._Windows(none, none, 0, 10).n_valid.numel() == 0
