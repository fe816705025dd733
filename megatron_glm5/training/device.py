"""The device this process computes and communicates on: its current CUDA device, or the CPU without CUDA."""
from __future__ import annotations

import torch


def current_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
