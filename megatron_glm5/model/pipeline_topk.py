"""IndexShare across pipeline stages: the top-k indices a model chunk hands to the next one.

A "shared" DSA layer reuses the top-k of the nearest earlier "full" layer (``AttentionInputs.topk_store``). When a
pipeline stage (or virtual stage) begins with a shared layer, that full layer ran on the previous stage, so the
previous stage sends its top-k ``[T, k]`` (``TOPK_DTYPE``, no gradient) alongside the activations and this stage
receives it into the store of its own forward before its first layer runs. Which chunk sends or receives which
layer's top-k is decided from the layout alone (:func:`topk_links`); ``GLM5TransformerBlock.forward`` calls
:func:`receive` before its layers and :func:`send` after them, once per forward (activation recomputation
replays the layers against the same store and communicates nothing).

Communicators. megatron-core's schedules exchange activations over the pipeline group. Extra messages on that
communicator would be matched in the wrong order under NCCL (the sender issues top-k then activations, the
receiver needs activations first to start its forward, then the top-k). So top-k travels on communicators of its
own, one per *direction* of every pipeline pair: rank i -> rank i+1 of each pipeline group (the wrap-around
rank P-1 -> rank 0 included, which feeds chunk c+1 with interleaved virtual stages). With one communicator per
pipeline, NCCL's in-order execution of a communicator's operations could deadlock with virtual stages (rank 0
queues a second send to rank 1 while rank 1 queues a send back to rank 0 before its second receive); with one
communicator per direction every communicator carries sends one way only.

Ordering argument. On the communicator src -> dst the sender sends, and the receiver receives, one message per
forward of a chunk boundary that starts on a shared layer, each in its own forward order. Every megatron-core
schedule runs the forwards of a rank in an order that is the same on every rank (no pipelining and 1F1B:
micro-batch 0, 1, ...; interleaved: ``get_schedule_table``, grouped by micro-batch group, then chunk, then
micro-batch; forward-only evaluation alike). A boundary links forward (chunk c, micro-batch m) of the sender to
(c, m) of the next rank, or to (c + 1, m) across the wrap-around; both maps preserve that order. So the n-th send
and the n-th receive belong to the same micro-batch and boundary. Deadlock-free: the sender posts its top-k
(``isend``, never blocking) before megatron-core sends the activations, and the receiver's blocking ``recv``
runs only once it has the activations of that forward, so the top-k is already on its way.

Sends are waited later (:func:`wait_pending_sends`, after every pipeline schedule, and opportunistically for the
ones already completed), never inside the forward: waiting for micro-batch m's top-k to arrive before sending
micro-batch m + 1 could deadlock in 1F1B (the next stage first needs this stage's receive of a gradient).
The groups are created collectively, identically on every rank, by :func:`setup_groups` (``build_model``), and
connected there with one small exchange each (NCCL would otherwise create a send/recv communicator at the first
top-k, a step that blocks until both ranks join, while the receiver waits for activations: a deadlock).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_glm5.errors import UserError
from megatron_glm5.ops import host_windows
from megatron_glm5.ops.reference import TOPK_DTYPE  # senders cast to it: the receiver allocates it unseen

# ---------------------------------------------------------------------------------------------------------------
# Layout: which chunk receives and sends which top-k (no communication)
# ---------------------------------------------------------------------------------------------------------------


class IndexShareAcrossStagesError(UserError, NotImplementedError):
    """A layout needs IndexShare top-k across pipeline stages where it cannot be passed on."""


@dataclass(frozen=True)
class TopkLinks:
    """IndexShare across a pipeline boundary, for one model chunk (megatron layer numbers, 1-based, or None).

    ``receive``: the full layer whose top-k this chunk gets from the previous stage (its first layer is shared);
    ``send``: the full layer whose top-k it hands to the next stage (the next chunk's first layer is shared),
    computed here or, when this chunk has no full layer, the one it received. See the module docstring.
    """
    receive: Optional[int] = None
    send: Optional[int] = None


def stage_layers(config, vp_stage, pp_rank) -> tuple[int, int]:
    """(offset, count): the main decoder layers of chunk (pp_rank, vp_stage), as megatron-core splits them."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return (get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank),
            get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank))


def topk_links(config, vp_stage=None, pp_rank=None) -> TopkLinks:
    """Which top-k the chunk (pp_rank, vp_stage) receives and sends. Only the sparse DSA stage selects keys: in
    dense-warmup nothing flows. Chunks follow megatron-core's order (chunk c of rank r feeds chunk c of rank r + 1,
    chunk c of the last rank feeds chunk c + 1 of rank 0), so a boundary is where this chunk starts or ends."""
    if config.pipeline_model_parallel_size == 1 or config.dsa_stage != "sparse":
        return TopkLinks()
    types = config.dsa_indexer_types
    offset, n = stage_layers(config, vp_stage, pp_rank)

    def shared_source(i):  # layer number of the full layer a chunk starting at layer i needs, if i is shared
        if 0 < i < len(types) and types[i] == "shared":
            return config.dsa_index_source_layer(i) + 1
        return None
    return TopkLinks(receive=shared_source(offset), send=shared_source(offset + n))


def _chunks(config):
    vpp = config.virtual_pipeline_model_parallel_size
    for pp_rank in range(config.pipeline_model_parallel_size):
        for vp_stage in (range(vpp) if vpp else [None]):
            yield pp_rank, vp_stage


def needs_topk_transfer(config) -> bool:
    """Whether some chunk of the layout receives IndexShare top-k from the previous pipeline stage."""
    return any(topk_links(config, vp, r).receive is not None for r, vp in _chunks(config))


def check_pipeline_split(config) -> None:
    """Check every (pipeline stage, virtual stage) of the layout, so that every rank reports the same error (a rank
    checking only its own stage would leave the others hanging in a collective).

    A stage may start on an IndexShare layer: the top-k of its full layer comes from the previous stage
    (this module), through GLM5TransformerBlock.forward. Still refused: megatron-core's combined
    1F1B schedule (``overlap_moe_expert_parallel_comm``), which runs the layers without the block's forward.
    """
    for pp_rank, vp_stage in _chunks(config):
        links = topk_links(config, vp_stage, pp_rank)
        if links.receive is None or not getattr(config, "overlap_moe_expert_parallel_comm", False):
            continue
        offset, _ = stage_layers(config, vp_stage, pp_rank)
        where = f"pipeline stage {pp_rank}" + (f" (virtual stage {vp_stage})" if vp_stage is not None else "")
        raise IndexShareAcrossStagesError(
            f"{where} starts on layer {offset} (0-based), an IndexShare ('shared') layer that needs the top-k "
            f"of full layer {links.receive - 1} from the previous stage; overlap_moe_expert_parallel_comm runs "
            "the layers without GLM5TransformerBlock.forward, which passes it on: turn that overlap off or split "
            "the layers so that every stage starts with a 'full' indexer layer")


# ---------------------------------------------------------------------------------------------------------------
# Communication
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class _Links:
    pp_group: object  # the megatron-core pipeline group these communicators were made for
    send_group: Optional[object]
    send_dst: Optional[int]  # global rank of the next pipeline stage
    recv_group: Optional[object]
    recv_src: Optional[int]  # global rank of the previous pipeline stage


_LINKS: Optional[_Links] = None
_PENDING: list = []  # (work, tensor) of isends not waited yet; the tensor stays alive until then


def setup_groups() -> None:
    """Create this rank's two top-k communicators (to the next and from the previous pipeline stage).

    Collective over all ranks: every rank must call it, in the same place (``build_model`` does, for every
    model chunk; calls after the first are no-ops while megatron-core's pipeline group stays the same).
    Nothing to do without pipeline parallelism.
    """
    global _LINKS
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    if _LINKS is not None and _LINKS.pp_group is pp_group:
        return
    wait_pending_sends()
    me = dist.get_rank()
    pipelines = [None] * dist.get_world_size()
    dist.all_gather_object(pipelines, tuple(dist.get_process_group_ranks(pp_group)))
    links = _Links(pp_group, None, None, None, None)
    pairs = []
    for ranks in sorted(set(pipelines)):  # the same list, in the same order, on every rank
        for i, src in enumerate(ranks):
            dst = ranks[(i + 1) % len(ranks)]
            pairs.append((src, dst, dist.new_group([src, dst])))
    for src, dst, group in pairs:
        if me == src:
            links.send_group, links.send_dst = group, dst
        if me == dst:
            links.recv_group, links.recv_src = group, src
        if me in (src, dst):
            _connect(group, src, dst, me)
    _LINKS = links


def _connect(group, src, dst, me) -> None:
    """Exchange one element now, in the global order of ``setup_groups``: NCCL creates a communicator for
    send/recv at its first use, a collective step that blocks until both ranks join; left to the first top-k
    of a forward it would deadlock (the receiver is waiting for activations that the sender sends only after
    that forward)."""
    nccl = "nccl" in str(dist.get_backend(group))  # "nccl", or "cpu:gloo,cuda:nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu"
    probe = torch.zeros(1, dtype=TOPK_DTYPE, device=device)
    if me == src:
        dist.isend(probe, dst=dst, group=group).wait()
    else:
        dist.recv(probe, src=src, group=group)


def _links() -> _Links:
    if _LINKS is None:
        raise RuntimeError("IndexShare top-k across pipeline stages: the communicators do not exist; build the "
                           "model with megatron_glm5.model.model.build_model (it calls pipeline_topk.setup_groups)")
    return _LINKS


def send(inputs, key) -> None:
    """Post the top-k of full layer ``key`` (this forward's store) to the next pipeline stage; does not block."""
    if key not in inputs.topk_store:
        raise RuntimeError(f"IndexShare across pipeline stages: the top-k of full layer {key} is not in this "
                           "forward's store, so it cannot be sent to the next stage")
    links = _links()
    topk = inputs.topk_store[key].detach().to(TOPK_DTYPE).contiguous()
    _reap_completed()
    _PENDING.append((dist.isend(topk, dst=links.send_dst, group=links.send_group), topk))


def receive(inputs, key, index_topk: int) -> None:
    """Receive the top-k of full layer ``key`` from the previous pipeline stage into this forward's store.

    Its shape comes from this forward's own inputs: [T, inputs.topk_width(index_topk)], as GLM5SparseAttention
    computes it on the sending stage for the same micro-batch.
    """
    links = _links()
    topk = torch.empty(inputs.num_tokens, inputs.topk_width(index_topk), dtype=TOPK_DTYPE,
                       device=inputs.key_start.device)
    dist.recv(topk, src=links.recv_src, group=links.recv_group)
    # the sender's indexer chose from the same windows: no row holds a key past its query_end, which the sparse
    # backward may use to size its dense products without reading the top-k back (ops/host_windows.py)
    query_end = host_windows.host_copy(inputs.query_end)
    if query_end.device.type == "cpu":
        host_windows.remember_row_ends(topk, query_end)
    inputs.topk_store[key] = topk


def _reap_completed() -> None:
    """Drop the sends that have completed (NCCL reports it; gloo's sends complete only in wait())."""
    keep = []
    for work, topk in _PENDING:
        if work.is_completed():
            work.wait()
        else:
            keep.append((work, topk))
    _PENDING[:] = keep


def wait_pending_sends() -> None:
    """Wait for every top-k sent so far. Call it after a pipeline schedule: by then the next stage has received
    them or can receive them without this rank (all of this schedule's activations have been sent)."""
    while _PENDING:
        work, _ = _PENDING.pop(0)
        work.wait()
