"""megatron-core patches that must precede ``import megatron.core`` (any device: they depend on triton and the
Python version). This module must not import megatron.core.
"""
from __future__ import annotations

import sys
import types
import typing

from megatron_glm5.mcore_patches.record import Patch, Phase


_PAGED_STASH_OPS = "megatron.core.transformer.moe.ops.paged_stash"


class _MissingTritonKernel:
    """Placeholder for a ``@triton.jit`` kernel; fails loudly if it is ever launched."""

    def __init__(self, name: str):
        self.__name__ = name

    def _fail(self, *args, **kwargs):
        raise RuntimeError(
            f"{_PAGED_STASH_OPS}.{self.__name__} needs triton (and CUDA); it is only used by "
            "moe_paged_stash, which this installation cannot run"
        )

    __getitem__ = _fail  # kernel[grid](...)
    __call__ = _fail


def _triton_free_paged_stash() -> bool:
    """Stub ``megatron/core/transformer/moe/ops/paged_stash.py`` when triton is not importable.

    That file starts with an unconditional ``import triton`` and is reached from
    ``import megatron.core`` itself (core/__init__ -> distributed -> finalize_model_grads ->
    pipeline_parallel.schedules -> transformer/moe/paged_stash.py -> ops/paged_stash.py), so
    without triton nothing in megatron-core can be imported ("No module named 'triton'").
    Its two kernels serve only the optional MoE paged-stash feature.  We stub this one module,
    not ``triton`` itself: a fake ``triton`` in sys.modules would make every ``try: import
    triton`` in megatron, torch and transformers believe triton is available.
    """
    if _PAGED_STASH_OPS in sys.modules:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        pass
    else:
        return False
    mod = types.ModuleType(_PAGED_STASH_OPS, "Stub of megatron-core's triton paged-stash kernels")
    mod.GLOBAL_BLOCK_SIZE = 1024  # same value as the real module
    mod.paged_stash_copy_kernel = _MissingTritonKernel("paged_stash_copy_kernel")
    mod.paged_stash_pop_kernel = _MissingTritonKernel("paged_stash_pop_kernel")
    mod.__all__ = ["GLOBAL_BLOCK_SIZE", "paged_stash_copy_kernel", "paged_stash_pop_kernel"]
    mod.__megatron_glm5_stub__ = True
    sys.modules[_PAGED_STASH_OPS] = mod
    return True


def _typing_override() -> bool:
    """Provide ``typing.override`` on Python < 3.12 (from typing_extensions).

    ``megatron/training/models/gpt.py`` and ``hybrid.py`` do ``from typing import ...,
    override`` (new in 3.12; megatron-core declares Requires-Python >= 3.12), so on 3.11
    importing them fails with "cannot import name 'override' from 'typing'".
    """
    if hasattr(typing, "override"):
        return False
    import typing_extensions

    typing.override = typing_extensions.override
    return True


PATCHES = (
    Patch(
        name='triton_free_paged_stash',
        site='megatron/core/transformer/moe/ops/paged_stash.py',
        why="without triton, `import megatron.core` fails on this module's unconditional `import triton`",
        test='tests/test_platform.py::test_shim_is_needed[triton_free_paged_stash]',
        phase=Phase.PRE_IMPORT, apply=_triton_free_paged_stash),
    Patch(
        name='typing_override',
        site='megatron/training/models/gpt.py, hybrid.py',
        why='on Python < 3.12 `from typing import override` fails',
        test='tests/test_platform.py::test_shim_is_needed[typing_override]',
        phase=Phase.PRE_IMPORT, apply=_typing_override),
)
