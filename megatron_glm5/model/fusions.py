"""``--fusions``: the elementwise regions of the training step, each run as one torch.compile'd function on CUDA.

A *region* is a plain torch function of tensors (RMSNorm, the RoPE rotations written into the layout the sparse
kernels read, the MoE router's top-k + normalisation, ...), defined next to the module that uses it and decorated
with :func:`region`. Called with ``fuse=False`` it runs eagerly, exactly as written; with ``fuse=True`` it runs
through ``torch.compile(fullgraph=True)`` (compiled on first use, forward and backward), which turns its chain of
casts, multiplies, slices and concatenations into a few Inductor/Triton kernels. The SwiGLU of the dense MLP, the
shared experts and the routed experts is our Triton kernel (model/swiglu.py), switched by the same choice.

Which path a call takes: :func:`on` -- the model config's ``elementwise_fusion`` (set from ``--fusions``) and a
CUDA tensor; the CPU path stays eager whatever the flag says. The flag: model/fusion_flags.py.
"""
from __future__ import annotations

import functools

import torch

__all__ = ["Region", "region", "on"]


class Region:
    """A function with an eager and a compiled path; ``fn(*args, fuse=False)``."""

    def __init__(self, fn):
        functools.update_wrapper(self, fn)
        self.eager = fn
        self._compiled = None

    def compiled(self):
        if self._compiled is None:
            self._compiled = torch.compile(self.eager, fullgraph=True)
        return self._compiled

    def __call__(self, *args, fuse: bool = False):
        return self.compiled()(*args) if fuse else self.eager(*args)


def region(fn) -> Region:
    """Decorator: ``fn`` becomes a :class:`Region`."""
    return Region(fn)


def on(config, x: torch.Tensor) -> bool:
    """Whether this call runs the fused regions: ``--fusions`` resolved to on (config.elementwise_fusion) and ``x``
    on a CUDA device."""
    return bool(getattr(config, "elementwise_fusion", False)) and x.is_cuda
