"""Runs the Triton kernels under TRITON_INTERPRET=1 (CPU) for tests/test_ops_triton.py.

Usage: python tests/triton_interp_runner.py CASES.pt RESULTS.pt
Reads a dict of named cases (inputs only), runs each through megatron_glm5.ops.triton_* and saves the outputs.
A separate process because the interpreter must be chosen before triton is first imported.
"""

import os
import sys

import torch

HOOKS = {"none": None, "mix": lambda x: x + 0.25 * x.roll(1, dims=-1)}


def run_topk(c):
    from megatron_glm5.ops import triton_indexer

    return triton_indexer.indexer_topk(c["q_idx"], c["k_idx"], c["weights"], c["topk"], c["key_start"],
                                       c["query_end"], c["scale"], config=dict(BLOCK_N=64, N_ITERS=1))


# backward variants (test_ops_triton.MLA_VARIANTS): BWD_CONFIG overrides, and "chunked" buffers of 3 query rows
MLA_VARIANTS = {"one_kernel": dict(DK="in_kernel", SKIP_PAD=False), "slots": dict(DK="slots"),
                "dense": dict(DK="dense"), "slots_no_skip": dict(DK="slots", SKIP_PAD=False),
                "slots_chunked": dict(DK="slots"), "dense_chunked": dict(DK="dense"),
                "dense_chunked_split1": dict(DK="dense", DENSE_SPLIT=1),
                "dense_chunked_split3": dict(DK="dense", DENSE_SPLIT=3),
                "dense_host_bounds": dict(DK="dense", ZEROS="memset"),
                "dense_chunked_host_bounds": dict(DK="dense", ZEROS="memset"),
                "dense_host_bounds_restore": dict(DK="dense", ZEROS="restore"),
                "dense_chunked_host_bounds_restore": dict(DK="dense", ZEROS="restore"),
                "dense_host_bounds_pieces": dict(DK="dense", ZEROS="memset", DENSE_PIECE_ROWS=7),
                "dense_chunked_host_bounds_pieces": dict(DK="dense", ZEROS="memset", DENSE_PIECE_ROWS=2),
                "dense_host_bounds_pieces_restore": dict(DK="dense", ZEROS="restore", DENSE_PIECE_ROWS=5),
                "dense_host_bounds_complement": dict(DK="dense", ZEROS="complement"),
                "dense_chunked_host_bounds_pieces_complement": dict(DK="dense", ZEROS="complement",
                                                                    DENSE_PIECE_ROWS=2)}


def run_mla(c):
    from megatron_glm5.ops import triton_sparse_mla

    q = c["q"].clone().requires_grad_()
    kv = c["kv"].clone().requires_grad_()
    res = {}
    default = dict(triton_sparse_mla.BWD_CONFIG)
    # the dense plans' chunk buffers start as NaN: a product reading an entry that nothing zeroed or wrote shows
    triton_sparse_mla._chunk_buffer = lambda size, dtype, device: torch.full((size,), float("nan"), dtype=dtype,
                                                                             device=device)
    budgets = triton_sparse_mla.DET_BUFFER_BYTES, triton_sparse_mla.PDS_BUFFER_BYTES
    for det, variant in [(m, None) for m in c["modes"]] + c.get("variants", []):
        q.grad = kv.grad = None
        triton_sparse_mla.BWD_CONFIG.update(BLOCK_N=16, H_SPLIT=2, DK_BLOCK_S=16, DENSE_BLOCK_K=16, DENSE_BLOCK_J=16,
                                            **MLA_VARIANTS.get(variant, {}))
        if variant and "chunked" in variant:
            row = c["indices"].shape[1] * q.shape[-1] * 4
            triton_sparse_mla.DET_BUFFER_BYTES = triton_sparse_mla.PDS_BUFFER_BYTES = 3 * row
        indices = c["indices"]
        if variant and "host_bounds" in variant:  # as the indexer leaves them: loose bounds (+2) still hold
            from megatron_glm5.ops import host_windows
            indices = indices.clone()
            bound = (indices.max(1).values.long() + 2).clamp(max=kv.shape[0] - 1)
            host_windows.remember_row_ends(indices, torch.where(indices.max(1).values >= 0, bound, -1))
        # "restore": the kept buffer must be all zero again after each backward, so a second backward (on it)
        # gives the same gradients; both are compared with the reference
        runs = []
        for _ in range(2 if variant and variant.endswith("restore") else 1):
            q.grad = kv.grad = None
            out, lse = triton_sparse_mla.sparse_mla(q, kv, indices, c["scale"], c["d_v"], deterministic=det)
            loss = (out * c["d_out"]).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * c["d_lse"]).sum()
            loss.backward()
            kept = [(bool(t.eq(0).all()), dirty) for t, dirty in triton_sparse_mla._kept_zero.buffers.values()]
            runs.append(dict(out=out.detach(), lse=lse.detach(), dq=q.grad.clone(), dkv=kv.grad.clone(), kept=kept))
        triton_sparse_mla.BWD_CONFIG.update(default)
        triton_sparse_mla.DET_BUFFER_BYTES, triton_sparse_mla.PDS_BUFFER_BYTES = budgets
        res[det if variant is None else (det, variant)] = dict(runs[-1], first=runs[0])
    return res


# the indexer KL's forms and d_k_idx paths (test_ops_triton.KL_MODES): config overrides, and whether host row
# bounds are left.  "auto*": the defaults (the slot form, DK auto); "dense*": its dense d_k_idx; "tiles*": the tile
# form
KL_DK = {"auto": ({}, False), "auto_bounds": ({}, True), "dense": (dict(FORM="slots", DK="dense"), True),
         "dense_chunked": (dict(FORM="slots", DK="dense", DENSE_ROWS=3), True),
         "dense_no_bounds": (dict(FORM="slots", DK="dense"), False),
         "tiles": (dict(FORM="tiles", TILES=dict(BLOCK_N=8)), True),
         "tiles_chunked": (dict(FORM="tiles", TILES=dict(BLOCK_N=16, BLOCK_T=2, ROWS=3)), True),
         "tiles_no_bounds": (dict(FORM="tiles"), False)}


def run_kl(c):
    """Each mode: (deterministic d_k_idx, the forward's lse passed or not, KL block size, d_k_idx path)."""
    from megatron_glm5.ops import host_windows, triton_kl, triton_kl_tiles, triton_sparse_mla

    lse = triton_sparse_mla.sparse_mla_fwd(c["q"], c["kv"], c["indices"], c["scale"], c["d_v"])[1]
    res = {}
    real_mm, real_tiles = triton_kl.mm_fp32_add_, triton_kl_tiles.kl_tiles
    for det, with_lse, block_n, dk in c["modes"]:
        overrides, bounds = KL_DK[dk]
        indices = c["indices"].clone()
        if bounds:  # as the indexer leaves them: loose bounds (+2) still hold
            top = indices.max(1).values.long()
            host_windows.remember_row_ends(indices, torch.where(top >= 0, (top + 2).clamp(max=c["kv"].shape[0] - 1),
                                                                -1))
        products, tiles = [], []
        triton_kl.mm_fp32_add_ = lambda acc, a, b: products.append(1) or real_mm(acc, a, b)
        triton_kl_tiles.kl_tiles = lambda *a, **k: tiles.append(1) or real_tiles(*a, **k)
        q_idx = c["q_idx"].clone().requires_grad_()
        k_idx = c["k_idx"].clone().requires_grad_()
        w = c["weights"].clone().requires_grad_()
        kl, n = triton_kl.indexer_kl_loss_sparse(
            q_idx, k_idx, w, c["idx_scale"], c["q"], c["kv"], c["scale"], indices, c["d_v"],
            token_mask=c.get("token_mask"), head_sum_reduce=HOOKS[c.get("hook", "none")],
            attn_lse=lse if with_lse else None, deterministic=det, config=dict(BLOCK_N=block_n, **overrides))
        kl.backward()
        triton_kl.mm_fp32_add_, triton_kl_tiles.kl_tiles = real_mm, real_tiles
        res[det, with_lse, block_n, dk] = dict(kl=kl.detach(), n=n, d_q_idx=q_idx.grad, d_k_idx=k_idx.grad,
                                               d_w=w.grad, dense=bool(products), tiles=bool(tiles))
    return res


def run_backend(c):
    from megatron_glm5.ops.triton_backend import TritonBackend

    b = TritonBackend(deterministic=True)
    out_dense, _ = b.sparse_mla(c["q"], c["kv"], None, c["scale"], c["d_v"], c["key_start"], c["query_end"])
    out_sparse, _ = b.sparse_mla(c["q"], c["kv"], c["indices"], c["scale"], c["d_v"])
    return dict(dense=out_dense, sparse=out_sparse)


def run_kl_given(c):
    """indexer_kl_grads from the case's head sums: (deterministic, SKIP_PAD, form) -> its five results (the tile
    form with the indexer's host row bounds, loose ones)."""
    from megatron_glm5.ops import host_windows, triton_kl

    out = {}
    for det, skip, form in ((False, True, "slots"), (False, False, "slots"), (True, True, "slots"),
                            (False, True, "tiles"), (True, True, "tiles")):
        indices = c["indices"].clone()
        if form == "tiles":
            top = indices.max(1).values.long()
            host_windows.remember_row_ends(indices, torch.where(top >= 0, (top + 2).clamp(
                max=c["k_idx"].shape[0] - 1), -1))
        out[det, skip, form] = triton_kl.indexer_kl_grads(
            c["q_idx"], c["k_idx"], c["weights"], indices, c["head_sums"], c["idx_scale"], deterministic=det,
            config=dict(BLOCK_N=8, SKIP_PAD=skip, FORM=form, TILES=dict(BLOCK_N=8, ROWS=5)))
    return out


def run_kl_after_topk(c):
    """Our indexer's top-k of the case's inputs, then indexer_kl_grads on it from the case's head sums: with the
    log-sum-exp the indexer remembered (by default), with INDEXER_LSE off, and from an equal copy of q_idx (another
    tensor: the remembered value must not be used) -- each with whether the KL kernel was given that LSE."""
    from megatron_glm5.ops import host_windows, triton_indexer, triton_kl

    indices = triton_indexer.indexer_topk(c["q_idx"], c["k_idx"], c["weights"], c["topk"], c["key_start"],
                                          c["query_end"], c["idx_scale"], config=dict(BLOCK_N=16, N_ITERS=1))
    kernel, given = triton_kl._indexer_kl_kernel, []

    class Spy:  # records LSE_GIVEN of every launch
        def __getitem__(self, grid):
            launch = kernel[grid]
            return lambda *a, **k: (given.append(k["LSE_GIVEN"]), launch(*a, **k))[1]

    out = dict(indices=indices, lse=host_windows.selected_lse(indices, c["q_idx"], c["k_idx"], c["weights"],
                                                              c["idx_scale"]))
    triton_kl._indexer_kl_kernel = Spy()
    try:
        for name, q_idx, cfg in (("remembered", c["q_idx"], {}), ("off", c["q_idx"], dict(INDEXER_LSE=False)),
                                 ("other_q", c["q_idx"].clone(), {})):
            for det in (False, True):
                given.clear()
                res = triton_kl.indexer_kl_grads(q_idx, c["k_idx"], c["weights"], indices, c["head_sums"],
                                                 c["idx_scale"], deterministic=det, config=dict(BLOCK_N=8, **cfg))
                out[name, det] = res + (list(given),)
    finally:
        triton_kl._indexer_kl_kernel = kernel
    c["q_idx"].add_(0)  # modified in place: its version moves on, so the remembered value no longer holds
    out["after_inplace"] = host_windows.selected_lse(indices, c["q_idx"], c["k_idx"], c["weights"], c["idx_scale"])
    return out


def run_complement_zero(c):
    """One chunk of a DensePlan with ZEROS "complement" on a NaN buffer: the buffer after views(0) (which zeroes),
    for the test to check entry by entry."""
    from megatron_glm5.ops import triton_sparse_mla as tsm

    tsm._chunk_buffer = lambda size, dtype, device: torch.full((size,), float("nan"), dtype=dtype, device=device)
    plan = tsm.DensePlan(c["n_q"], c["h"], c["n_q"], c["pieces"], torch.float32, "cpu", zeros="complement",
                         indices=c["indices"])
    plan.views(0)
    return dict(buffer=plan.buffers[0].clone(), p_off=plan.p_off)


def run_slot_ends(c):
    """used_slot_ends of each list of the case for each step (the one-pass kernel under the interpreter)."""
    from megatron_glm5.ops import triton_sparse_mla as tsm

    return {(i, step): tsm.used_slot_ends(idx, c["n_keys"], step) for i, idx in enumerate(c["lists"])
            for step in c["steps"]}


RUNNERS = {"slot_ends": run_slot_ends, "complement_zero": run_complement_zero, "topk": run_topk, "mla": run_mla, "kl": run_kl,
           "kl_given": run_kl_given, "backend": run_backend, "kl_after_topk": run_kl_after_topk}


def main(cases_path, results_path):
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (by the runners' imports)
    if "triton" in sys.modules:
        raise RuntimeError("triton was imported before TRITON_INTERPRET was set")
    cases = torch.load(cases_path)
    results = {name: RUNNERS[c["kind"]](c) for name, c in cases.items()}
    torch.save(results, results_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
