"""Compatibility shim for Triton's CPU interpreter (TRITON_INTERPRET=1), used by the CPU tests.

Triton 3.6's interpreter converts a scalar kernel argument used as a loop bound with ``int(array)``, which NumPy >= 2.4
refuses for the 1-element arrays it stores scalars in.  ``apply()`` re-registers that conversion with an explicit
element read.  It changes nothing when the interpreter is off (compiled kernels never go through this path).
"""

from __future__ import annotations

import os

_applied = False


def runs_kernels(t) -> bool:
    """Whether a Triton kernel runs on tensor ``t``: a CUDA tensor, or any under the interpreter (TRITON_INTERPRET=1);
    elsewhere the callers take their torch form."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def apply() -> None:
    global _applied
    if _applied or os.environ.get("TRITON_INTERPRET", "0") != "1":
        return
    import numpy as np
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    _applied = True
