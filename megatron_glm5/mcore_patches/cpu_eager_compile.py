"""Without CUDA, megatron-core's import-time ``torch.compile`` decorations are no-ops (a pre-import patch).

megatron-core decorates its small fused helpers at import time: ``megatron/core/jit.py`` sets
``jit_fuser = torch.compile`` and modules apply it (``@jit_fuser``: activations, norms, the MoE router's
``_apply_expert_bias``, the flex dispatcher's ``dispatch_preprocess``...); ``transformer/moe/router.py`` also has a
bare ``@torch.compile`` (the CUDA-graphed inference router). Each decoration imports torch._dynamo and
torch._inductor (~1 s of every interpreter's start), and on CPU the first call of a helper compiles C++ with
inductor (needs a C++ compiler; ~1.5 s per process, for helpers of a few elementwise ops). Without CUDA this
patch makes those decorations return the function itself, as megatron-core's own ``disable_jit_fuser`` does: the
helpers run eagerly. Only ``torch.compile`` called from a megatron.core module's code is affected, and only while
megatron.core modules are imported after the patch; torch.compile elsewhere is untouched.

This module must not import megatron.core.
"""
from __future__ import annotations

import sys

from megatron_glm5.mcore_patches.record import Patch, Phase

_PACKAGE = "megatron.core"


def _from_megatron_core(depth: int) -> bool:
    name = sys._getframe(depth + 1).f_globals.get("__name__", "")
    return name == _PACKAGE or name.startswith(_PACKAGE + ".")


class _EagerCompile:
    """``torch.compile`` as seen by megatron.core's modules while they are imported: called from megatron.core
    code it returns the function itself (``@torch.compile``, ``@torch.compile(...)``, ``jit_fuser = torch.compile``
    then ``@jit_fuser``); from anywhere else it is the real ``torch.compile``."""

    def __init__(self, real):
        self.real = real

    def __call__(self, model=None, **kwargs):
        if not _from_megatron_core(1):
            return self.real(model, **kwargs) if model is not None else self.real(**kwargs)
        return model if model is not None else (lambda fn: fn)


class _SwapCompileLoader:
    """Wraps a megatron.core module's loader: ``torch.compile`` is the eager stand-in while the module runs."""

    def __init__(self, loader, eager: _EagerCompile):
        self._loader = loader
        self._eager = eager

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        import torch

        before = torch.compile
        torch.compile = self._eager
        try:
            self._loader.exec_module(module)
        finally:
            torch.compile = before

    def __getattr__(self, name):  # get_code, get_source, is_package, get_resource_reader ...
        return getattr(self._loader, name)


class _MegatronCoreFinder:
    """A ``sys.meta_path`` finder: megatron.core's modules are found as usual, loaded through
    ``_SwapCompileLoader``."""

    def __init__(self, eager: _EagerCompile):
        self.eager = eager

    def find_spec(self, name, path=None, target=None):
        if name != _PACKAGE and not name.startswith(_PACKAGE + "."):
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _SwapCompileLoader(spec.loader, self.eager)
                return spec
        return None


def _cpu_eager_compile() -> bool:
    """Install the finder that loads ``megatron/core/**.py`` with ``torch.compile`` as a no-op (CPU only).

    Needed before ``import megatron.core``: ``megatron/core/jit.py`` binds ``jit_fuser = torch.compile`` and the
    fused helpers are decorated when their modules are imported. Does nothing with CUDA, when megatron.core is
    already imported, or when the finder is already installed.
    """
    import torch

    if torch.cuda.is_available() or _PACKAGE in sys.modules:
        return False
    if any(isinstance(f, _MegatronCoreFinder) for f in sys.meta_path):
        return False
    sys.meta_path.insert(0, _MegatronCoreFinder(_EagerCompile(torch.compile)))
    return True


PATCHES = (
    Patch(
        name='cpu_eager_compile',
        site='megatron/core/jit.py (jit_fuser) and its @jit_fuser users, transformer/moe/router.py (@torch.compile)',
        why='without CUDA every interpreter imports torch._dynamo/_inductor for the decorations (~1 s) and compiles '
            'C++ at the first MoE step',
        test='tests/test_platform.py::test_shim_is_needed[cpu_eager_compile]',
        phase=Phase.PRE_IMPORT, apply=_cpu_eager_compile),
)
