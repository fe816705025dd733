"""The fixed-point sums' scale, bound and read-back (megatron_glm5/ops/fixed_point_sum.py), on CPU without Triton:
hand-worked figures, and the sparse-MLA dkv bound against every contribution computed here in float64."""
import math

import torch

from megatron_glm5.ops import fixed_point_sum as fps

F64 = torch.float64


def test_scale_is_the_largest_power_of_two_keeping_the_bound_below_2_to_62():
    # B = 3: log2 3 = 1.585, floor(62 - 1.585) = 60 -> s = 2^60 (3 * 2^60 < 2^62 <= 3 * 2^61)
    s, inv = fps.scales(torch.tensor(3.0)).tolist()
    assert s == 2.0 ** 60 and inv == 2.0 ** -60
    # B = 2^10 exactly: 2^52
    assert fps.scales(torch.tensor(1024.0)).tolist() == [2.0 ** 52, 2.0 ** -52]
    # B = 0 (all contributions zero) and tiny: capped at 2^120
    assert fps.scales(torch.tensor(0.0)).tolist() == [2.0 ** 120, 2.0 ** -120]
    assert fps.scales(torch.tensor(1e-30)).tolist() == [2.0 ** 120, 2.0 ** -120]
    # not finite (an input inf / NaN): the read-back factor is NaN
    for b in (float("inf"), float("nan")):
        s, inv = fps.scales(torch.tensor(b)).tolist()
        assert math.isfinite(s) and math.isnan(inv)


def test_decode_reads_back_and_a_raised_flag_makes_every_entry_nan():
    pair = fps.scales(torch.tensor(3.0))  # s = 2^60
    acc = torch.tensor([[2 ** 60, -(2 ** 59)], [3, 0]], dtype=torch.int64)
    got = fps.decode(acc, pair, fps.new_flag("cpu"))
    assert got.dtype == torch.float32 and got.tolist() == [[1.0, -0.5], [3 * 2.0 ** -60, 0.0]]
    flag = fps.new_flag("cpu")
    flag[0] = 1
    assert torch.isnan(fps.decode(acc, pair, flag)).all()


def test_sparse_mla_dkv_bound_hand_worked():
    # one query, two heads; |q| <= 3; kv latent (d_v = 2) norms 5 and 1 -> V = 5; ||dO|| = 2, 1; delta -0.5, 0.25
    q = torch.tensor([[[1.0, -3.0, 2.0], [0.5, 0.0, 1.0]]])
    kv = torch.tensor([[3.0, 4.0, 9.0], [0.0, 1.0, -7.0]])
    norms = torch.tensor([[2.0, 1.0]])
    delta = torch.tensor([[-0.5, 0.25]])
    # rows: 0.5 * 3 * (2 * 5 + 0.5) + 2 = 17.75; 0.5 * 3 * (1 * 5 + 0.25) + 1 = 8.875; B = 17.75 * (1 * 2) * 1.0625
    got = fps.sparse_mla_dkv_bound(q, kv, norms, delta, 0.5, 2)
    assert got.dtype == torch.float32 and float(got) == 17.75 * 2 * 1.0625
    assert float(fps.sparse_mla_dkv_bound(q[:0], kv, norms[:0], delta[:0], 0.5, 2)) == 0.0


def test_sparse_mla_dkv_bound_holds_for_every_entry():
    """sum over (query, head) of |ds q| (+ |p dO| on the latent columns) for every key and column, in float64 from
    the softmax over each query's selected keys, is below the bound -- across scales of the inputs and a d_lse."""
    g = torch.Generator().manual_seed(0)
    n_q, h, d_v, d_r, n_k, topk = 24, 4, 16, 8, 30, 6
    for mag in (1e-3, 1.0, 50.0):
        q = torch.randn(n_q, h, d_v + d_r, generator=g) * mag
        kv = torch.randn(n_k, d_v + d_r, generator=g) * mag
        d_out = torch.randn(n_q, h, d_v, generator=g) / mag
        d_lse = torch.randn(n_q, h, generator=g)
        idx = torch.stack([torch.randperm(n_k, generator=g)[:topk] for _ in range(n_q)])
        idx[::5, -2:] = -1  # unused slots
        ok = idx >= 0
        sel = kv.to(F64)[idx.clamp(min=0)]  # [T, K, D]
        scale = (d_v + d_r) ** -0.5
        s = torch.einsum("thd,tkd->thk", q.to(F64), sel) * scale
        p = torch.softmax(s.masked_fill(~ok[:, None, :], float("-inf")), dim=-1)
        out = torch.einsum("thk,tkd->thd", p, sel[..., :d_v])
        delta = (out * d_out.to(F64)).sum(-1) - d_lse.to(F64)
        dp = torch.einsum("thd,tkd->thk", d_out.to(F64), sel[..., :d_v])
        ds = p * (dp - delta[..., None]) * scale
        contrib = (ds.abs()[..., None] * q.to(F64).abs()[:, :, None, :])  # [T, h, K, D]
        contrib[..., :d_v] += p.abs()[..., None] * d_out.to(F64).abs()[:, :, None, :]
        per_key = torch.zeros(n_k, d_v + d_r, dtype=F64)
        per_key.index_add_(0, idx.clamp(min=0).reshape(-1),
                           (contrib.sum(1) * ok[..., None]).reshape(-1, d_v + d_r))
        norms = torch.linalg.vector_norm(d_out, dim=-1)
        bound = fps.sparse_mla_dkv_bound(q, kv, norms, delta.float(), scale, d_v)
        assert per_key.max() <= float(bound), (mag, float(per_key.max()), float(bound))
        # and not absurdly loose: within the T x h factor the docstring names (and the norms' slack)
        assert float(bound) <= per_key.max() * n_q * h * 1e3, mag


def test_indexer_dk_bound_hand_worked_and_holds_for_every_entry():
    # two queries, two index heads: max |q_idx| 4; sum_h |w| = 0.5 + 1.5 = 2 (query 1); B = 2 x 0.25 x 2 x 4 x 1.0625
    q_idx = torch.tensor([[[1.0, -4.0], [2.0, 0.0]], [[0.5, 1.0], [-1.0, 3.0]]])
    w = torch.tensor([[0.25, -0.5], [0.5, -1.5]])
    assert float(fps.indexer_dk_bound(q_idx, w, 0.25)) == 2 * 0.25 * 2.0 * 4.0 * 1.0625
    # every d_k_idx entry's sum of |g w relu'(a) scale q_idx| in float64 is below it
    g = torch.Generator().manual_seed(1)
    n_q, h, d, n_k, topk = 20, 4, 8, 25, 6
    q_idx, k_idx = torch.randn(n_q, h, d, generator=g), torch.randn(n_k, d, generator=g)
    w = torch.randn(n_q, h, generator=g)
    idx = torch.stack([torch.randperm(n_k, generator=g)[:topk] for _ in range(n_q)])
    a = torch.einsum("thd,tkd->thk", q_idx.to(F64), k_idx.to(F64)[idx]) * 0.3
    z = (w.to(F64)[:, :, None] * a.clamp(min=0)).sum(1)
    target = torch.softmax(torch.randn(n_q, topk, generator=g, dtype=F64), -1)
    grad = torch.softmax(z, -1) - target
    da = (grad[:, None, :] * w.to(F64)[:, :, None] * 0.3 * (a > 0)).abs()  # [T, h, K]
    contrib = torch.einsum("thk,thd->tkd", da, q_idx.to(F64).abs())
    per_key = torch.zeros(n_k, d, dtype=F64).index_add_(0, idx.reshape(-1), contrib.reshape(-1, d))
    assert per_key.max() <= float(fps.indexer_dk_bound(q_idx, w, 0.3))
