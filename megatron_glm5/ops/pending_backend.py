"""A GPU backend registered by name before its kernels ship: ``--attn NAME`` then says what is missing (package,
CUDA GPU) or that the kernels arrive in a later release; ``--attn auto`` never picks it (``implemented`` is False)."""

from __future__ import annotations

import importlib
from typing import Optional

from . import base
from .base import AttentionBackend, BackendUnavailable, no_cuda_reason

__all__ = ["PendingGPUBackend"]


class PendingGPUBackend(AttentionBackend):
    """A GPU backend whose kernels are not part of this release."""

    implemented = False

    def __init__(self, name: str, module: str, install_hint: str):
        self.name = name
        self.module = module
        self.install_hint = install_hint
        self._has_package: Optional[bool] = None

    def has_package(self) -> bool:
        if self._has_package is None:
            try:
                importlib.import_module(self.module)
                self._has_package = True
            except Exception:  # ImportError, or a broken install failing at import time
                self._has_package = False
        return self._has_package

    def available(self) -> bool:
        """Package and GPU present (the ops still refuse: no kernels)."""
        return self.has_package() and base.cuda_available()

    def not_shipped_message(self) -> str:
        return f"--attn {self.name}: kernels arrive in a later release; use --attn torch"

    def unavailable_reason(self) -> Optional[str]:
        if not self.has_package():
            return f"--attn {self.name} needs the {self.module} package: {self.install_hint}"
        return no_cuda_reason(self.name) or self.not_shipped_message()

    def _refuse(self, *args, **kwargs):
        raise BackendUnavailable(self.not_shipped_message())

    indexer_topk = _refuse
    sparse_mla = _refuse
    indexer_kl_loss = _refuse
