"""``--dispatcher hybridep``: hierarchical (inter-node, then intra-node) MoE token dispatch.

Two implementations behind one flag, chosen once per process by :func:`hybridep_backend`:

- ``deep_ep``: megatron-core's ``MoEFlexTokenDispatcher`` with its ``hybridep`` backend (DeepEP's fused
  ``HybridEPBuffer`` kernels), when ``deep_ep.HybridEPBuffer`` imports and CUDA is present;
- ``torch``: :class:`HierarchicalTokenDispatcher` below, plain ``all_to_all_single`` calls on two sub-groups of
  the expert-parallel group; it runs anywhere torch.distributed does (gloo on CPU included).

The torch dispatcher groups the EP ranks into nodes (``--node-size`` GPUs per node; megatron-core lays out the
expert grid with the expert-TP rank innermost, then EP, so with ``--etp 1``, the only expert TP it supports,
consecutive EP ranks sit on consecutive GPUs; the grouping is read from the real global ranks, not assumed). With ``n`` EP ranks per node, ``N`` nodes and ``L`` experts per
rank, the ``n * L`` experts of node ``k`` live on EP ranks ``k*n .. k*n+n-1``:

dispatch
  1. inter-node: every token goes at most once to each node holding one of its experts, to the rank of that node
     with the same local index as the sender (rail-aligned: one all_to_all over the ``N`` ranks sharing a local
     index), carrying its routing row and combine weights for that node's experts;
  2. intra-node: the receiving (relay) rank sends one copy per selected expert to the rank holding it (one
     all_to_all over the node's ``n`` ranks); the expert rank orders its tokens by local expert.
combine (the reverse)
  2'. the expert outputs (already weighted by the combine weights in the experts) return to the relay rank,
      which sums them per token: only one vector per (token, destination node) crosses nodes;
  1'. the relay sends these sums back across nodes; the source rank sums over destination nodes.

Both stages are differentiable (megatron-core's autograd all_to_all; gathers whose backward scatter-adds), and
the result equals the alltoall dispatcher's up to the order of the fp32 additions.

With ``--moe-permute-fusion`` (the default with CUDA and triton) both gathers (steps 1 and 2) and both sums
(2' and 1') are the fused kernels of ops/triton_moe_permute.py (one row map per stage from the stage's routing):
each token's rows are summed by one program in a fixed order, so the combine is deterministic, where
``index_add`` on a GPU adds with atomics in a varying order.
"""
from __future__ import annotations

import logging
import os
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from megatron_glm5.errors import UserError
from megatron_glm5.model.permute_fusion import moe_permute_fusion_enabled

logger = logging.getLogger(__name__)

class HybridEPLayoutError(UserError, ValueError):
    """--node-size / --ep / --etp do not form whole nodes for the hierarchical dispatcher."""


# ---------------------------------------------------------------------------------------------------------------
# Backend selection
# ---------------------------------------------------------------------------------------------------------------


def choose_backend(cuda_available: bool, hybridep_importable: bool) -> str:
    """``deep_ep`` (megatron-core's flex dispatcher, HybridEP backend) only with both CUDA and
    ``deep_ep.HybridEPBuffer``; otherwise the torch.distributed implementation."""
    return "deep_ep" if cuda_available and hybridep_importable else "torch"


def _hybridep_importable() -> bool:
    try:
        from deep_ep import HybridEPBuffer  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA extension
        return False
    return True


_BACKEND: Optional[str] = None


def hybridep_backend() -> str:
    """The backend of this process (probed once, logged once)."""
    global _BACKEND
    if _BACKEND is None:
        cuda = torch.cuda.is_available()
        _BACKEND = choose_backend(cuda, cuda and _hybridep_importable())
        how = ("megatron-core's flex dispatcher with DeepEP's HybridEP kernels" if _BACKEND == "deep_ep" else
               "the torch.distributed hierarchical dispatcher (deep_ep.HybridEPBuffer with CUDA not available)")
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.info("--dispatcher hybridep: using %s", how)
    return _BACKEND


# ---------------------------------------------------------------------------------------------------------------
# Node layout and sub-groups
# ---------------------------------------------------------------------------------------------------------------


def default_node_size(world_size: int) -> int:
    """$LOCAL_WORLD_SIZE (torchrun's GPUs per node), else min(world size, 8)."""
    env = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    return int(env) if env.isdigit() and int(env) > 0 else min(world_size, 8)


def ep_ranks_per_node(ep_global_ranks: Sequence[int], node_size: int) -> int:
    """How many EP ranks share a node (node of global rank g: g // node_size). Every node must hold the same
    number of the group's ranks, as one consecutive run of EP ranks; raises HybridEPLayoutError otherwise."""
    ranks = list(ep_global_ranks)
    nodes = [g // node_size for g in ranks]
    runs: List[Tuple[int, int]] = []  # (node, count) in EP-rank order
    for node in nodes:
        if runs and runs[-1][0] == node:
            runs[-1] = (node, runs[-1][1] + 1)
        else:
            runs.append((node, 1))
    counts = {c for _, c in runs}
    if len({node for node, _ in runs}) != len(runs) or len(counts) != 1:
        raise HybridEPLayoutError(
            f"--dispatcher hybridep: --node-size {node_size} must divide --ep {len(ranks)} (or --ep divide "
            f"--node-size): nodes of {node_size} GPUs split the expert-parallel group (global ranks {ranks}) "
            "unevenly")
    return counts.pop()


class _Groups:
    """This rank's node layout: ``n`` EP ranks per node, ``N`` nodes, the intra-node group (its node's ranks) and
    the inter-node group (the ranks with its local index on every node); a group of one rank is None."""

    def __init__(self, n: int, num_nodes: int, intra, inter):
        self.n, self.num_nodes, self.intra, self.inter = n, num_nodes, intra, inter


_LAYOUTS: Dict[Tuple[Tuple[Tuple[int, ...], ...], int], Optional[_Groups]] = {}  # (all EP groups, node size)
_ACTIVE: Dict[Tuple[int, ...], _Groups] = {}  # this rank's EP group -> its groups, from the latest setup


def setup_hybridep_groups(config) -> None:
    """Create the intra-/inter-node sub-groups of every expert-parallel group. Collective: every rank calls it
    at model build (build_model does), creating all groups in the same order. Idempotent per layout."""
    from megatron.core import parallel_state

    etp = config.expert_tensor_parallel_size or 1
    if etp > 1:
        raise HybridEPLayoutError(
            f"--dispatcher hybridep with --etp {etp}: the torch.distributed hierarchical dispatcher supports "
            "--etp 1 only (megatron-core's HybridEP backend, used when deep_ep is installed, handles expert TP); "
            "use --etp 1 or --dispatcher alltoall")
    if config.moe_pad_expert_input_to_capacity or config.moe_shared_expert_overlap:
        raise HybridEPLayoutError(
            "--dispatcher hybridep (torch.distributed): moe_pad_expert_input_to_capacity and "
            "moe_shared_expert_overlap are not supported; use --dispatcher alltoall")
    world = dist.get_world_size() if dist.is_initialized() else 1
    node_size = config.moe_hybridep_node_size or default_node_size(world)
    ep_group = parallel_state.get_expert_model_parallel_group()
    mine = tuple(dist.get_process_group_ranks(ep_group)) if world > 1 else (0,)
    if world > 1:
        gathered: List = [None] * world
        dist.all_gather_object(gathered, mine)
        all_groups = sorted(set(gathered))
    else:
        all_groups = [mine]
    key = (tuple(all_groups), node_size)
    if key not in _LAYOUTS:
        _LAYOUTS[key] = _create_groups(all_groups, node_size, dist.get_rank() if world > 1 else 0)
    _ACTIVE[mine] = _LAYOUTS[key]


def _create_groups(all_groups, node_size: int, me: int) -> Optional[_Groups]:
    layouts = [(ranks, ep_ranks_per_node(ranks, node_size)) for ranks in all_groups]
    found = None
    for ranks, n in layouts:  # the same new_group calls, in the same order, on every rank
        intra_lists = [ranks[i:i + n] for i in range(0, len(ranks), n)]
        inter_lists = [ranks[j::n] for j in range(n)]
        intra = [dist.new_group(list(r)) if len(r) > 1 else None for r in intra_lists]
        inter = [dist.new_group(list(r)) if len(r) > 1 else None for r in inter_lists]
        if me in ranks:
            i = ranks.index(me)
            found = _Groups(n, len(ranks) // n, intra[i // n], inter[i % n])
    return found


def _groups_for(ep_group) -> _Groups:
    mine = tuple(dist.get_process_group_ranks(ep_group)) if ep_group is not None and ep_group.size() > 1 else None
    if mine is None:
        return _Groups(1, 1, None, None)
    found = _ACTIVE.get(mine)
    if found is None:
        raise RuntimeError("--dispatcher hybridep: setup_hybridep_groups(config) must run on every rank before "
                           "the model is built (build_model does it)")
    return found


# ---------------------------------------------------------------------------------------------------------------
# The dispatcher
# ---------------------------------------------------------------------------------------------------------------


def _exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """all_to_all of equal slices of an integer tensor (no autograd)."""
    if group is None:
        return counts.clone()
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


def _all_to_all(group, x: torch.Tensor, output_splits: List[int], input_splits: List[int]) -> torch.Tensor:
    if group is None:
        return x
    from megatron.core.tensor_parallel import all_to_all

    return all_to_all(group, x, output_splits, input_splits)


def _sum_rows(x: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
    """out[index[i]] += x[i] into ``rows`` rows, accumulated in fp32 (differentiable)."""
    out = torch.zeros(rows, x.shape[-1], dtype=torch.float32, device=x.device)
    return out.index_add(0, index, x.float()).to(x.dtype)


def _local_expert_order(rows: int, cols: int) -> torch.Tensor:
    """Chunk order that turns a [rows][cols] chunk layout into [cols][rows]."""
    return torch.arange(rows * cols).view(rows, cols).t().reshape(-1)


class HierarchicalTokenDispatcher(MoETokenDispatcher):
    """Drop-in for megatron-core's MoEAlltoAllTokenDispatcher (same constructor and seven-step interface) that
    sends each token across nodes at most once per destination node. See the module docstring."""

    def __init__(self, num_local_experts: int, local_expert_indices: List[int], config, pg_collection=None):
        if pg_collection is None:
            from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
            pg_collection = get_default_pg_collection()
        super().__init__(config=config, pg_collection=pg_collection)
        if self.tp_size > 1:
            raise HybridEPLayoutError(f"--dispatcher hybridep with --etp {self.tp_size}: the torch.distributed "
                                      "dispatcher supports --etp 1 only")
        self.num_local_experts = num_local_experts
        self.local_expert_indices = local_expert_indices
        self.num_experts = config.num_moe_experts
        groups = _groups_for(self.ep_group)
        self.node_ranks, self.num_nodes = groups.n, groups.num_nodes
        self.intra_group, self.inter_group = groups.intra, groups.inter
        assert self.node_ranks * self.num_nodes == self.ep_size
        assert self.num_experts == self.ep_size * num_local_experts
        self.fused = moe_permute_fusion_enabled(getattr(config, "moe_triton_permute_fusion", None))

    def _gather(self, x: torch.Tensor, routing: torch.Tensor, probs: Optional[torch.Tensor] = None, pairs=None):
        """Rows of x for the routed pairs (col, row) = ``routing.t().nonzero()`` of routing [rows, cols] (``pairs``
        when the caller has them), in that column-major order, with probs[row, col] when probs are given; and what
        sums them back (:meth:`_sum_back`): the fused kernels' row map, else the row index."""
        if not self.fused:
            col, row = pairs if pairs is not None else routing.t().nonzero(as_tuple=True)
            return x.index_select(0, row), (probs[row, col] if probs is not None else None), row
        from megatron_glm5.ops import triton_moe_permute as fused

        row_map = fused.build_row_map(routing, pairs[1].numel() if pairs is not None else None)
        rows, p = fused.permute_tokens(x, row_map, probs)
        return rows, p, row_map

    def _sum_back(self, y: torch.Tensor, back, rows: int) -> torch.Tensor:
        """Each row's gathered copies (from :meth:`_gather`) summed back into ``rows`` rows, fp32 accumulation: one
        program per row in a fixed order (fused), else index_add."""
        if isinstance(back, torch.Tensor):
            return _sum_rows(y, back, rows)
        from megatron_glm5.ops import triton_moe_permute as fused

        return fused.unpermute_tokens(y, back)

    # -- dispatch ------------------------------------------------------------------------------------------
    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """Inter-node send buffer: one row per (destination node, token) pair, node-major, with that node's slice
        of the routing map and the combine weights."""
        self.hidden_shape = hidden_states.shape
        hidden = hidden_states.reshape(-1, self.hidden_shape[-1])
        tokens = hidden.shape[0]
        per_node = self.num_experts // self.num_nodes
        node_routing = routing_map.reshape(tokens, self.num_nodes, per_node)
        node_map = node_routing.any(dim=-1)  # [tokens, nodes]
        dest_node, token = node_map.t().nonzero(as_tuple=True)
        self._tokens = tokens
        self._inter_send = node_map.sum(dim=0)
        x, _, self._inter_back = self._gather(hidden, node_map, pairs=(dest_node, token))
        p = probs.reshape(tokens, self.num_nodes, per_node)[token, dest_node]
        self._relay_routing = node_routing[token, dest_node]
        return x, p

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Across nodes (rail-aligned), then from the relay rank to the ranks of the selected experts."""
        send = self._inter_send
        recv = _exchange_counts(send, self.inter_group)
        self._inter_in, self._inter_out = send.tolist(), recv.tolist()
        x = _all_to_all(self.inter_group, hidden_states, self._inter_out, self._inter_in)
        p = _all_to_all(self.inter_group, probs, self._inter_out, self._inter_in)
        with torch.no_grad():
            routing = _all_to_all(self.inter_group, self._relay_routing.to(torch.uint8), self._inter_out,
                                  self._inter_in).bool()
        self._relay_rows = x.shape[0]

        # on the relay rank: one row per (selected expert of this node, token), expert-major
        x_sel, p_sel, self._relay_back = self._gather(x, routing, p)
        L = self.num_local_experts
        per_expert = routing.sum(dim=0).long()  # [n * L]
        from_ranks = _exchange_counts(per_expert, self.intra_group).view(self.node_ranks, L)  # [source, local]
        self._intra_in = per_expert.view(self.node_ranks, L).sum(dim=1).tolist()
        self._counts = from_ranks.cpu()
        self._intra_out = self._counts.sum(dim=1).tolist()
        x = _all_to_all(self.intra_group, x_sel, self._intra_out, self._intra_in)
        p = _all_to_all(self.intra_group, p_sel, self._intra_out, self._intra_in)
        return x, p

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Order the received [source rank][local expert] chunks by local expert."""
        if self.num_local_experts > 1:
            from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs

            hidden_states, probs = sort_chunks_by_idxs(
                hidden_states, self._counts.reshape(-1), _local_expert_order(self.node_ranks, self.num_local_experts),
                probs=probs)
        return hidden_states, self._counts.sum(dim=0), probs

    # -- combine -------------------------------------------------------------------------------------------
    def combine_preprocess(self, hidden_states: torch.Tensor):
        if self.num_local_experts > 1:
            from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs

            hidden_states, _ = sort_chunks_by_idxs(
                hidden_states, self._counts.t().reshape(-1),
                _local_expert_order(self.num_local_experts, self.node_ranks))
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor):
        """Back to the relay rank, summed there per token, then back across nodes."""
        y = _all_to_all(self.intra_group, hidden_states, self._intra_in, self._intra_out)
        y = self._sum_back(y, self._relay_back, self._relay_rows)
        return _all_to_all(self.inter_group, y, self._inter_in, self._inter_out)

    def combine_postprocess(self, hidden_states: torch.Tensor):
        """Sum over destination nodes into the original token order."""
        out = self._sum_back(hidden_states, self._inter_back, self._tokens)
        return out.view(self.hidden_shape)
