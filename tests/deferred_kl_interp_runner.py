"""Runs the deferred indexer KL (megatron_glm5/ops/deferred_kl.py) under TRITON_INTERPRET=1 (CPU) for
tests/test_triton_deferred_kl.py.

Usage: python tests/deferred_kl_interp_runner.py CASES.pt RESULTS.pt
"kernel" cases: the sparse-MLA backward with and without head sums (NaN-poisoned buffer) per backward variant, and
the separate head-sum kernel.  "model" cases: one training step of a tiny model (2 layers: one with an indexer, one IndexShare)
through the Triton backend per run: forward-time KL (defer False) or deferred (True), recompute, per-token loss.
"""

import os
import sys

import torch

# (BWD_CONFIG overrides, deterministic): the default ("auto" dk, padding skipped; one partial block), 4-key blocks
# (the blocks after a short row's last key skipped: their zeros), two head groups (per-group sums; "slots", both
# dkv modes), the one-kernel backward without the padding skip, "dense"
BWD_VARIANTS = {"default": (dict(BLOCK_N=16, H_SPLIT=1), False), "block4": (dict(BLOCK_N=4, H_SPLIT=1), False),
                "two_groups": (dict(BLOCK_N=8, H_SPLIT=2, DK="slots", DK_BLOCK_S=16), False),
                "two_groups_det": (dict(BLOCK_N=8, H_SPLIT=2, DK="slots", DK_BLOCK_S=16), True),
                "one_kernel": (dict(BLOCK_N=8, H_SPLIT=2, DK="in_kernel", SKIP_PAD=False), False),
                "dense": (dict(BLOCK_N=4, DK="dense"), False)}


def run_kernel(c):
    from megatron_glm5.ops import triton_kl, triton_sparse_mla as tsm

    q, kv, idx, scale, d_v = c["q"], c["kv"], c["indices"], c["scale"], c["d_v"]
    out, lse = tsm.sparse_mla_fwd(q, kv, idx, scale, d_v)
    res = dict(separate=triton_kl.head_summed_probs(q, kv, idx, scale, d_v, attn_lse=lse))
    for name, (cfg, det) in BWD_VARIANTS.items():
        plain = tsm.sparse_mla_bwd(q, kv, idx, out, lse, c["d_out"], c["d_lse"], scale, d_v, deterministic=det,
                                   config=cfg)
        hs = torch.full(idx.shape, float("nan"))
        got = tsm.sparse_mla_bwd(q, kv, idx, out, lse, c["d_out"], c["d_lse"], scale, d_v, deterministic=det,
                                 config=cfg, head_sums=hs)
        res[name] = dict(head_sums=hs, dq=got[0], dkv=got[1], dq_plain=plain[0], dkv_plain=plain[1])
    return res


def run_model(c):
    import megatron_glm5
    from megatron_glm5 import GLM5Config, build_model
    from megatron_glm5.model.dsa import GLM5SparseAttention
    from megatron_glm5.ops.triton_backend import TritonBackend

    res = {}
    for run_name, settings in c["runs"].items():
        rec = dict(settings)
        defer, per_token = rec.pop("defer"), rec.pop("per_token")
        megatron_glm5.initialize_model_parallel(seed=0)
        cfg = GLM5Config.from_preset("tiny")
        cfg.num_hidden_layers, cfg.indexer_types = 2, ["full", "shared"]  # one KL layer, one IndexShare layer
        model = build_model(cfg, mtp=False, dsa_stage="sparse", dsa_indexer_loss_coeff=0.5, dsa_backend="torch",
                            calculate_per_token_loss=per_token, **rec).train()
        attn = [m for m in model.modules() if isinstance(m, GLM5SparseAttention)]
        for m in attn:
            m.backend = TritonBackend(deterministic=True, defer_kl=defer)
        loss = model(c["ids"][:, :-1], labels=c["ids"][:, 1:]).float().mean()
        kl_before = [m.last_indexer_loss for m in attn if m.indexer is not None]
        loss.backward()
        res[run_name] = dict(
            loss=loss.detach(), kl_before_backward=kl_before,
            kl=[m.last_indexer_loss for m in attn if m.indexer is not None],
            kl_count=[m.kl_log[1] for m in attn if m.indexer is not None],
            grads={n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    return res


RUNNERS = {"kernel": run_kernel, "model": run_model}


def main(cases_path, results_path):
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (by the runners' imports)
    if "triton" in sys.modules:
        raise RuntimeError("triton was imported before TRITON_INTERPRET was set")
    cases = torch.load(cases_path)
    torch.save({name: RUNNERS[c["kind"]](c) for name, c in cases.items()}, results_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
