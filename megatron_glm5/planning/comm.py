"""Alpha-beta times of the collectives a training step runs, and where each group's ranks sit.

A collective over ``n`` ranks moving ``nbytes`` per rank costs ``alpha + nbytes * (n - 1) / n / bandwidth`` (ring
all-gather / reduce-scatter; an all-to-all sends the same share to the others); the bandwidth is NVLink's when the
whole group is inside one node and the network's otherwise (an all-to-all that spans nodes: its intra- and
inter-node shares go in parallel, the slower one counts).  Rank order is megatron-core's: tp-cp-ep-dp-pp for the
dense groups, etp-ep-edp-pp for the expert groups (tensor parallel innermost), so a group of consecutive
``stride``-spaced ranks spans ``size * stride`` ranks.  These are ESTIMATES from datasheet bandwidths; the
latencies below are assumptions, not measurements.
"""
from __future__ import annotations

ALPHA_NVLINK_S = 10e-6  # assumed per-collective latency inside a node
ALPHA_NETWORK_S = 30e-6  # assumed per-collective latency across nodes
GB = 1e9


def spans_nodes(size: int, stride: int, gpus_per_node: int) -> bool:
    return size > 1 and size * stride > gpus_per_node


def ring(nbytes: float, size: int, stride: int, gpu) -> float:
    """All-gather or reduce-scatter of ``nbytes`` (the full buffer) per rank over ``size`` ranks."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    across = spans_nodes(size, stride, gpu.gpus_per_node)
    bw = (gpu.network_gb_s if across else gpu.nvlink_gb_s) * GB
    return (ALPHA_NETWORK_S if across else ALPHA_NVLINK_S) + nbytes * (size - 1) / size / bw


def all_to_all(nbytes: float, size: int, stride: int, gpu) -> float:
    """All-to-all where each rank sends ``nbytes`` spread evenly over the ``size`` ranks of its group."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    per_node = max(1, min(size, gpu.gpus_per_node // max(stride, 1)))  # group members sharing this node
    intra = nbytes * (per_node - 1) / size
    inter = nbytes * (size - per_node) / size
    t = intra / (gpu.nvlink_gb_s * GB)
    if inter > 0:
        return ALPHA_NETWORK_S + max(t, inter / (gpu.network_gb_s * GB))
    return ALPHA_NVLINK_S + t


def p2p(nbytes: float, across_nodes: bool, gpu) -> float:
    """One pipeline send/recv of ``nbytes``."""
    if nbytes <= 0:
        return 0.0
    if across_nodes:
        return ALPHA_NETWORK_S + nbytes / (gpu.network_gb_s * GB)
    return ALPHA_NVLINK_S + nbytes / (gpu.nvlink_gb_s * GB)
