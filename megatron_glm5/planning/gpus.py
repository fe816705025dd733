"""The GPUs the planner knows: memory, dense bf16 rate, NVLink and network bandwidth, each with its source.

``memory_mib`` is the total an ``nvidia-smi`` of that part reports (what the CUDA allocator can reach, less the
context); bandwidths are per GPU and per direction.  Rates are datasheet peaks unless ``measured_bf16_tflops`` says
otherwise: the planner multiplies the datasheet rate by a stated efficiency until a calibration table
(calibration.py) replaces it with measured layer times.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

from megatron_glm5.arguments import ArgumentError


HOST_USABLE = 0.75  # of a node's RAM for pinned optimizer state; the rest for the OS, data workers, checkpoints: an assumption


@dataclass(frozen=True)
class GPU:
    name: str
    memory_mib: int
    bf16_dense_tflops: float
    nvlink_gb_s: float  # per GPU, per direction, inside one NVLink domain (a node of 8 here)
    network_gb_s: float  # per GPU, per direction, between nodes
    gpus_per_node: int
    hbm_tb_s: float  # memory bandwidth (the optimizer step is bound by it)
    sources: str
    measured_bf16_tflops: Optional[float] = None  # a bf16 GEMM measured on this part in this project
    measured_note: str = ""
    # host link and host memory (the optimizer's CPU offload): PCIe per GPU per direction, and the host DRAM
    # bandwidth of a node's CPUs divided by its GPUs (torch's CPU AdamW is bound by it)
    pcie_gb_s: float = 64.0
    host_memory_gb_s: float = 77.0
    host_ram_gib: float = 2048.0  # system memory of one node (its GPUs share it)
    host_sources: str = ""

    @property
    def host_gib_per_gpu(self) -> float:
        """The host memory a rank's offloaded optimizer state may take: HOST_USABLE of the node's RAM / its GPUs."""
        return HOST_USABLE * self.host_ram_gib / self.gpus_per_node

    @property
    def memory_gib(self) -> float:
        return self.memory_mib / 1024


GPUS: Dict[str, GPU] = {g.name: g for g in (
    GPU("h100-80gb", memory_mib=81559, bf16_dense_tflops=989.0, nvlink_gb_s=450.0, network_gb_s=50.0,
        gpus_per_node=8, hbm_tb_s=3.35,
        sources="NVIDIA H100 datasheet (SXM5: 80 GB HBM3 at 3.35 TB/s, 989 TFLOP/s dense BF16, NVLink 4 900 GB/s "
                "bidirectional); DGX H100: 8 x ConnectX-7 400 Gb/s, one per GPU; nvidia-smi total 81559 MiB",
        pcie_gb_s=64.0, host_memory_gb_s=77.0,
        host_sources="H100 SXM datasheet: PCIe Gen5 128 GB/s (64 per direction); DGX H100: 2 x Xeon Platinum 8480C, "
                     "8 channels of DDR5-4800 each (2 x 307 GB/s), 2 TB of system memory for 8 GPUs"),
    GPU("h200-141gb", memory_mib=143771, bf16_dense_tflops=989.0, nvlink_gb_s=450.0, network_gb_s=50.0,
        gpus_per_node=8, hbm_tb_s=4.8,
        sources="NVIDIA H200 datasheet (SXM: 141 GB HBM3e at 4.8 TB/s, the H100's 989 TFLOP/s dense BF16, NVLink 4 "
                "900 GB/s bidirectional); HGX H200: one 400 Gb/s NIC per GPU; nvidia-smi total 143771 MiB",
        measured_bf16_tflops=751.0,
        measured_note="bf16 8192^3 torch.matmul on the lent H200, 2026-11-30 (GLM5_REFERENCE.md)",
        pcie_gb_s=64.0, host_memory_gb_s=77.0,
        host_sources="H200 datasheet: PCIe Gen5 128 GB/s (64 per direction); DGX H200: the DGX H100's 2 x Xeon "
                     "Platinum 8480C (2 x 8 channels DDR5-4800), 2 TB of system memory for 8 GPUs"),
    GPU("b200-180gb", memory_mib=183359, bf16_dense_tflops=2250.0, nvlink_gb_s=900.0, network_gb_s=50.0,
        gpus_per_node=8, hbm_tb_s=8.0,
        sources="NVIDIA DGX B200 datasheet (180 GB HBM3e per GPU at 8 TB/s, 72 PFLOP/s FP8 training per 8 GPUs = 2.25 "
                "PFLOP/s dense BF16 per GPU, NVLink 5 1.8 TB/s bidirectional, 8 x ConnectX-7 400 Gb/s); "
                "nvidia-smi total 183359 MiB (a public nvidia-smi print, not seen here)",
        pcie_gb_s=64.0, host_memory_gb_s=90.0,
        host_sources="DGX B200: 2 x Xeon Platinum 8570 (PCIe Gen5: 64 GB/s per direction per x16 link to the GPU; "
                     "8 channels of DDR5-5600 each, 2 x 358 GB/s), 2 TB of system memory (4 TB optional) for 8 GPUs"),
)}


def get_gpu(name: str) -> GPU:
    """The GPU called ``name``; a one-line UserError naming --gpu and the choices otherwise."""
    try:
        return GPUS[name]
    except KeyError:
        raise ArgumentError(f"--gpu {name!r} is not a GPU the planner knows; choose one of: {', '.join(GPUS)}", flag="--gpu") from None
