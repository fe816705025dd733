"""Helper of tests/test_layouts_moe.py (launched with torchrun; not a test module itself).

One dispatch -> experts -> combine round trip and its backward through megatron-core's MoEAlltoAllTokenDispatcher
and through HierarchicalTokenDispatcher (--dispatcher hybridep, torch.distributed), on the same random tokens,
routing and combine weights, for several --node-size values at the process count's EP size. The "experts" are
fixed random matrices, one per expert, applied with the combine weight as GLM5GroupedExperts does. Every rank
writes ``<out>/node<S>.rank<R>.pt``: both dispatchers' outputs, input gradients (tokens and combine weights),
tokens per local expert and, per local expert, the sorted rows it received; its routing map, the rows the
hierarchical dispatcher sent to each node, and the node layout it derived (EP ranks per node, nodes, sub-group
sizes). ``--fused``: the hierarchical dispatcher with --moe-permute-fusion (our Triton kernels, run by Triton's
CPU interpreter), against the same unfused alltoall reference.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

TOKENS, HIDDEN, TOPK = 24, 16, 3


def run(dispatcher, x, probs, routing_map, weights, local_experts):
    """(output, d output / d x, d output / d probs, tokens per expert, per-expert sorted received rows)."""
    x = x.clone().requires_grad_(True)
    p = probs.clone().requires_grad_(True)
    h, pp = dispatcher.dispatch_preprocess(x, routing_map, p)
    h, pp = dispatcher.token_dispatch(h, pp)
    h, counts, pp = dispatcher.dispatch_postprocess(h, pp)
    counts = [int(c) for c in counts]
    received = [rows.detach().sort(dim=0).values for rows in torch.split(h, counts)]
    out = torch.cat([(rows @ weights[e]) * w.unsqueeze(-1)
                     for e, rows, w in zip(local_experts, torch.split(h, counts), torch.split(pp, counts))])
    out = dispatcher.combine_postprocess(dispatcher.token_combine(dispatcher.combine_preprocess(out)))
    g = torch.Generator().manual_seed(7 + dist.get_rank())
    (out * torch.randn(out.shape, generator=g)).sum().backward()
    return {"out": out.detach(), "grad_x": x.grad, "grad_probs": p.grad, "counts": counts, "received": received}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--node-sizes", default="1,2,4")
    ap.add_argument("--fused", action="store_true")
    opts = ap.parse_args()
    if opts.fused:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

    from megatron_glm5 import platform
    platform.apply_pre_import_shims()
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    platform.initialize_model_parallel(ep=world, seed=1234)

    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from megatron_glm5.config import GLM5Config
    from megatron_glm5.model.hybridep_dispatcher import HierarchicalTokenDispatcher, setup_hybridep_groups

    experts = GLM5Config.from_preset("tiny").n_routed_experts
    local = experts // world
    local_experts = list(range(rank * local, (rank + 1) * local))
    g = torch.Generator().manual_seed(100)
    weights = torch.randn(experts, HIDDEN, HIDDEN, generator=g)  # the same on every rank
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=g)
    logits = torch.randn(TOKENS, experts, generator=g)
    idx = logits.topk(TOPK, dim=-1).indices
    routing_map = torch.zeros(TOKENS, experts, dtype=torch.bool).scatter(1, idx, True)
    probs = torch.zeros(TOKENS, experts).scatter(1, idx, torch.rand(TOKENS, TOPK, generator=g) + 0.1)
    os.makedirs(opts.out, exist_ok=True)
    pg = get_default_pg_collection()
    for node_size in map(int, opts.node_sizes.split(",")):
        cfg = GLM5Config.from_preset("tiny").to_transformer_config(
            expert_model_parallel_size=world, moe_router_topk=TOPK, moe_token_dispatcher_type="alltoall",
            moe_hybridep_node_size=node_size)
        setup_hybridep_groups(cfg)
        ref = MoEAlltoAllTokenDispatcher(local, local_experts, config=cfg, pg_collection=pg)
        hier_cfg = cfg
        if opts.fused:
            hier_cfg = GLM5Config.from_preset("tiny").to_transformer_config(
                expert_model_parallel_size=world, moe_router_topk=TOPK, moe_token_dispatcher_type="alltoall",
                moe_hybridep_node_size=node_size, moe_triton_permute_fusion=True)
        hier = HierarchicalTokenDispatcher(local, local_experts, config=hier_cfg, pg_collection=pg)
        result = {"alltoall": run(ref, x, probs, routing_map, weights, local_experts),
                  "hybridep": run(hier, x, probs, routing_map, weights, local_experts),
                  "routing_map": routing_map, "rows_sent_per_node": list(hier._inter_in), "fused": hier.fused,
                  "layout": (hier.node_ranks, hier.num_nodes,
                             hier.intra_group.size() if hier.intra_group is not None else 1,
                             hier.inter_group.size() if hier.inter_group is not None else 1)}
        torch.save(result, os.path.join(opts.out, f"node{node_size}.rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
