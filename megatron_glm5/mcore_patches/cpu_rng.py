"""CPU-only patch: megatron-core's "CUDA" RNG tracker keeps CPU generator states."""
from __future__ import annotations

import contextlib

import torch

from megatron_glm5.mcore_patches.record import Patch, Phase


def _cpu_rng_tracker() -> bool:
    """Keep megatron's "CUDA" RNG tracker states in the CPU generator.

    ``megatron/core/tensor_parallel/random.py``: ``CudaRNGStatesTracker.add`` calls
    ``torch.cuda.get_rng_state()`` and ``fork`` calls ``_get_cuda_rng_state`` ->
    ``torch.cuda.random.get_rng_state``; both fail with "Torch not compiled with CUDA
    enabled" (``_set_cuda_rng_state`` would silently queue a lazy CUDA call instead).  They
    are reached from ``model_parallel_cuda_manual_seed``, from every weight init of
    tensor-parallel layers (``get_cuda_rng_tracker().fork()``), dropout in TP regions, and
    activation recomputation (``CheckpointFunction`` saves/restores ``_get_all_rng_states``).

    On CPU the generator that dropout and init draw from is the CPU default generator, so the
    tracker's named states are CPU generator states.  ``fork`` is re-implemented with the same
    nesting semantics but without upstream's "CPU RNG state changed within GPU RNG context"
    check, which on CPU would warn on every fork that draws a random number.
    """
    from megatron.core.tensor_parallel import random as mrandom

    base = mrandom.CudaRNGStatesTracker
    default_name = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME

    class CpuRNGStatesTracker(base):
        """CudaRNGStatesTracker whose named states are CPU default-generator states."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception('seed {} already exists'.format(seed))
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception('cuda rng state {} already exists'.format(name))
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name=default_name):
            if name not in self.states_:
                raise Exception('cuda rng state {} is not added'.format(name))
            outer_name = self._current_state_name
            outer_state = torch.get_rng_state()
            if outer_name != "default-rng":
                self.states_[outer_name] = outer_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                if self._current_state_name != name:
                    raise Exception(
                        f'current state name {self._current_state_name} is not the same as '
                        f'the desired state name {name}.'
                    )
                self.states_[name] = torch.get_rng_state()
                if outer_name != "default-rng":
                    outer_state = self.states_[outer_name]
                torch.set_rng_state(outer_state)
                self._current_state_name = outer_name

    def _get_cuda_rng_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def _set_cuda_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    CpuRNGStatesTracker.__qualname__ = CpuRNGStatesTracker.__name__
    CpuRNGStatesTracker.__module__ = __name__
    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
    mrandom._get_cuda_rng_state = _get_cuda_rng_state
    mrandom._set_cuda_rng_state = _set_cuda_rng_state
    tracker = mrandom._CUDA_RNG_STATE_TRACKER
    if type(tracker) is base:  # created before the shim: keep it, switch its methods
        tracker.__class__ = CpuRNGStatesTracker
    return True


PATCHES = (
    Patch(
        name='cpu_rng_tracker',
        site='megatron/core/tensor_parallel/random.py CudaRNGStatesTracker',
        why="the tracker calls torch.cuda's RNG state functions: 'Torch not compiled with CUDA enabled'",
        test='tests/test_platform.py::test_shim_is_needed[cpu_rng_tracker]',
        phase=Phase.CPU, apply=_cpu_rng_tracker),
)
