"""Runs the fused KL-target forward under TRITON_INTERPRET=1 (CPU) for tests/test_fused_kl_head_sums.py.

Usage: python tests/fused_kl_interp_runner.py CASES.pt RESULTS.pt
Each case: the Triton sparse forward with and without ``head_probs``, the separate head-sum kernel (given the
forward's lse), and the sparse KL with its own head-sum kernel and with the forward's head sums.
"""

import sys

import torch

HOOKS = {"none": None, "mix": lambda x: x + 0.25 * x.roll(1, dims=-1)}


def kl_run(fn, c):
    q_idx = c["q_idx"].clone().requires_grad_()
    k_idx = c["k_idx"].clone().requires_grad_()
    w = c["weights"].clone().requires_grad_()
    kl, n = fn(q_idx, k_idx, w)
    kl.backward()
    return dict(kl=kl.detach(), n=n, d_q_idx=q_idx.grad, d_k_idx=k_idx.grad, d_w=w.grad)


def run(c):
    from megatron_glm5.ops import triton_kl, triton_sparse_mla

    q, kv, idx, scale, d_v = c["q"], c["kv"], c["indices"], c["scale"], c["d_v"]
    res = {}
    cfg = dict(BLOCK_N=c["block_n"])
    out0, lse0 = triton_sparse_mla.sparse_mla_fwd(q, kv, idx, scale, d_v, config=cfg)
    probs = torch.full(idx.shape, float("nan"))  # NaN-poisoned: every slot must be written
    out1, lse1 = triton_sparse_mla.sparse_mla_fwd(q, kv, idx, scale, d_v, config=cfg, head_probs=probs)
    res.update(out0=out0, lse0=lse0, out1=out1, lse1=lse1, fused=probs)
    res["separate_lse"] = triton_kl.head_summed_probs(q, kv, idx, scale, d_v, attn_lse=lse0)
    hook = HOOKS[c["hook"]]

    def kl_with(head_sums):
        return lambda qi, ki, w: triton_kl.indexer_kl_loss_sparse(
            qi, ki, w, c["idx_scale"], q, kv, scale, idx, d_v, token_mask=c["token_mask"], head_sum_reduce=hook,
            attn_lse=lse0, deterministic=True, config=dict(BLOCK_N=8), attn_head_probs=head_sums)

    res["kl_separate"] = kl_run(kl_with(None), c)
    res["kl_fused"] = kl_run(kl_with(probs.clone()), c)
    return res


def main(cases_path, results_path):
    cases = torch.load(cases_path)
    torch.save({name: run(c) for name, c in cases.items()}, results_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
