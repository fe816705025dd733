"""The top-k index tensors DSA passes between the indexer, the sparse attention kernels, the IndexShare layers
and pipeline stages: int32 global key rows ``[T, width]``, -1 in unused slots.

``TOPK_DTYPE`` is their one dtype: every producer (ops/ backends' indexer_topk, the pipeline receive buffer in
model/pipeline_topk.py) makes or casts to it. This module imports only torch, so ops/ and model/ both use it.
"""
from __future__ import annotations

import torch

TOPK_DTYPE = torch.int32
