"""The attention-backend registry: ``--attn NAME`` -> backend, and the order ``--attn auto`` tries them.

The backends' names exist here only (``BACKEND_NAMES``; ``arguments.ATTN_BACKENDS`` is "auto" plus these).  Nothing
in ops/ imports this module; it imports the backend modules, none of which imports triton, tilelang or a GPU
library at module level, so the registry loads on any machine.  To add a backend: write ``ops/NAME_backend.py``
(an ``AttentionBackend`` subclass; see docs/design.md, "Attention backends") and add it to BACKENDS and
AUTO_PREFERENCE below.
"""

from __future__ import annotations

import logging
from typing import Dict, Optional, Set

from . import autotune
from .base import AttentionBackend, BackendUnavailable
from .cudnn_backend import CudnnBackend
from .flashmla_backend import FlashMLABackend
from .tilelang_backend import TilelangBackend
from .torch_backend import TorchBackend
from .triton_backend import TritonBackend

__all__ = ["ATTN_CHOICES", "AUTO_PREFERENCE", "BACKENDS", "BACKEND_NAMES", "get_backend"]

logger = logging.getLogger("megatron_glm5.ops")

BACKENDS: Dict[str, AttentionBackend] = {
    "torch": TorchBackend(),
    "triton": TritonBackend(),
    "tilelang": TilelangBackend(),
    "cudnn": CudnnBackend(),
    "flashmla": FlashMLABackend(),
}
BACKEND_NAMES = tuple(BACKENDS)
#: the values of --attn
ATTN_CHOICES = ("auto", *BACKEND_NAMES)

#: order in which "auto" tries backends (fastest first) when nothing is measured (no shape given, no CUDA, one
#: backend, the benchmark failed) and among backends measured within autotune.TIE_MARGIN of each other
# fastest first, by the 4-layer GLM-5 proxy's training step on the H200 at seq 4096 (docs/performance.md): cudnn
# (cuDNN backward, FlashMLA forward when installed) 228 ms, tilelang (all TileLang but the fused KL kernel) 279,
# flashmla (FlashMLA forward, Triton backward) 336, triton 346
AUTO_PREFERENCE = ("cudnn", "tilelang", "flashmla", "triton", "torch")

_ALIASES = {"flash_mla": "flashmla", "flash-mla": "flashmla", "reference": "torch"}
_logged: Set[str] = set()
_measured: Dict[autotune.AttnShape, AttentionBackend] = {}


def _log_once(requested: str, backend: AttentionBackend) -> None:
    if backend.name not in _logged:
        _logged.add(backend.name)
        logger.info("attention backend: %s (requested --attn %s)", backend.name, requested)


def _auto(shape: Optional[autotune.AttnShape]) -> AttentionBackend:
    """--attn auto: the implemented, available backends (torch only when nothing else is) in AUTO_PREFERENCE's
    order, ranked by this GPU's measurement at ``shape`` (ops/autotune.py) when a shape is given."""
    ready = [BACKENDS[c] for c in AUTO_PREFERENCE if BACKENDS[c].implemented and BACKENDS[c].available()]
    gpu = [b for b in ready if b.name != "torch"]
    if shape is None or len(gpu) <= 1:
        return (gpu or ready)[0]
    if shape not in _measured:
        _measured[shape] = autotune.rank(gpu, shape)[0][0]
    return _measured[shape]


def get_backend(name: str = "auto", shape: Optional[autotune.AttnShape] = None) -> AttentionBackend:
    """The attention backend for ``--attn name``.

    "auto": the fastest implemented and available backend ("torch" when no GPU kernel can run): measured at
    ``shape`` on this GPU (``autotune.rank``, cached per GPU, versions and shape) when given, else the fixed order.  Unknown name:
    ValueError listing the choices.  A known backend that cannot run: BackendUnavailable (an ImportError) with a
    one-line reason -- missing package (with the install step), no CUDA GPU, or kernels not shipped yet.
    """
    requested = str(name).strip().lower()
    key = _ALIASES.get(requested, requested)
    if key == "auto":
        backend = _auto(shape)
        _log_once(requested, backend)
        return backend
    if key not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of: {', '.join(ATTN_CHOICES)}")
    backend = BACKENDS[key]
    backend.check()
    _log_once(requested, backend)
    return backend
