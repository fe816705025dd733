"""Platform layer: CUDA detection, megatron-core compatibility shims, one-call parallel init.

megatron-core 0.19.2 assumes a CUDA build of torch (and Python >= 3.12).  This project also
runs on CPU-only torch (gloo, unit tests, notebooks, conversion tools), so this module keeps
every workaround in one place, each as a small named function whose docstring says which
megatron-core code needs it and why.

Two phases:

* :func:`apply_pre_import_shims` must run before anything imports ``megatron.core``
  (``megatron_glm5/__init__.py`` calls it).  These are needed whenever their condition holds
  (no triton, Python < 3.12), with or without CUDA.
* :func:`apply_cpu_shims` runs after ``megatron.core`` can be imported and only when CUDA is
  absent; with CUDA it does nothing.  :func:`initialize_model_parallel` calls it.

Both are idempotent.  ``SHIMS`` maps every shim name to its function, in application order;
``APPLIED`` lists the names actually applied in this process.  Setting
``MEGATRON_GLM5_DISABLE_SHIMS=name1,name2`` skips those shims (the tests use it to prove that
each shim is needed).

This module must not import ``megatron.core`` at module level.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import types
import typing
from typing import Callable, Dict, List, Optional, Tuple

import torch

__all__ = [
    "HAS_CUDA",
    "DISABLE_ENV",
    "SHIMS",
    "PRE_IMPORT_SHIMS",
    "CPU_SHIMS",
    "APPLIED",
    "apply_pre_import_shims",
    "apply_cpu_shims",
    "disabled_shims",
    "ParallelSizes",
    "initialize_model_parallel",
    "destroy_model_parallel",
]

HAS_CUDA: bool = torch.cuda.is_available()

DISABLE_ENV = "MEGATRON_GLM5_DISABLE_SHIMS"

# name -> shim function, in application order.  A shim returns True when it changed
# something and False when its condition does not hold (nothing to do).
SHIMS: Dict[str, Callable[[], bool]] = {}
PRE_IMPORT_SHIMS: Tuple[str, ...] = ()
CPU_SHIMS: Tuple[str, ...] = ()
APPLIED: List[str] = []


def _register(phase: str):
    def deco(fn: Callable[[], bool]) -> Callable[[], bool]:
        global PRE_IMPORT_SHIMS, CPU_SHIMS
        name = fn.__name__.lstrip("_")
        SHIMS[name] = fn
        if phase == "pre_import":
            PRE_IMPORT_SHIMS += (name,)
        else:
            CPU_SHIMS += (name,)
        return fn

    return deco


def disabled_shims() -> frozenset:
    """Names listed in ``$MEGATRON_GLM5_DISABLE_SHIMS`` (comma separated).

    Raises ValueError for an unknown name, so that a typo cannot silently disable nothing.
    """
    raw = os.environ.get(DISABLE_ENV, "")
    names = frozenset(n.strip() for n in raw.split(",") if n.strip())
    unknown = names - set(SHIMS)
    if unknown:
        raise ValueError(
            f"{DISABLE_ENV} names unknown shim(s) {sorted(unknown)}; known: {list(SHIMS)}"
        )
    return names


def _apply(names: Tuple[str, ...]) -> None:
    skip = disabled_shims()
    for name in names:
        if name in APPLIED or name in skip:
            continue
        if SHIMS[name]():
            APPLIED.append(name)


# ---------------------------------------------------------------------------------------
# Pre-import shims
# ---------------------------------------------------------------------------------------

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


@_register("pre_import")
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


@_register("pre_import")
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


def apply_pre_import_shims() -> List[str]:
    """Apply the shims that must precede ``import megatron.core``.  Idempotent.

    Returns ``APPLIED``.
    """
    _apply(PRE_IMPORT_SHIMS)
    return APPLIED


# ---------------------------------------------------------------------------------------
# CPU runtime shims (only without CUDA)
# ---------------------------------------------------------------------------------------


@_register("cpu")
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


def _cpu_device() -> torch.device:
    return torch.device("cpu")


@_register("cpu")
def _cuda_current_device() -> bool:
    """Make ``torch.cuda.current_device()`` return ``torch.device('cpu')``.

    megatron-core uses it as the default device for tensors it creates, e.g.
    ``RotaryEmbedding``/``YarnRotaryEmbedding.__init__`` (inv_freq; megatron/core/models/common/
    embeddings/rotary_pos_embedding.py), ``TopKRouter`` buffers
    and ``gating``, ``_AllToAll.forward`` in tensor_parallel/mappings.py (EP > 1 output
    buffer), ``MultiTokenPredictionBlock``, DDP buffers, tensor_parallel.layers weight
    allocation (``use_cpu_initialization=False``), ``p2p_communication`` shape buffers.  On a
    CPU build every call raises "Torch not compiled with CUDA enabled" before any tensor
    exists, so a TorchFunctionMode cannot catch it.  Call sites that do
    ``torch.device("cuda", torch.cuda.current_device())`` (nccl_allocator, fault_injector)
    remain unsupported on CPU.
    """
    torch.cuda.current_device = _cpu_device
    return True


class _CpuEvent:
    """Stand-in for ``torch.cuda.Event``: CPU work is synchronous, so events are always done."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False, external=False):
        self.enable_timing = enable_timing

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def query(self):
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, end_event):
        return 0.0


class _CpuStream:
    """Stand-in for ``torch.cuda.Stream``: one synchronous CPU queue, every wait is a no-op."""

    def __init__(self, device=None, priority=0, **kwargs):
        self.device = torch.device("cpu")
        self.priority = priority

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        event = event if event is not None else _CpuEvent()
        event.record(self)
        return event

    def query(self):
        return True

    def synchronize(self):
        pass


_CPU_DEFAULT_STREAM = _CpuStream()


def _cpu_current_stream(device=None) -> _CpuStream:
    return _CPU_DEFAULT_STREAM


def _cpu_stream_context(stream=None):
    return contextlib.nullcontext(stream)


def _cpu_synchronize(device=None) -> None:
    pass


@_register("cpu")
def _cuda_streams() -> bool:
    """Replace ``torch.cuda.{Stream, Event, current_stream, default_stream, stream,
    synchronize}`` with synchronous CPU stand-ins.

    ``MoEAlltoAllTokenDispatcher.__init__`` (megatron/core/transformer/moe/token_dispatcher.py)
    creates ``torch.cuda.Stream()`` ("torch.cuda.Stream requires CUDA support" on CPU); its
    ``_maybe_dtoh_and_synchronize`` uses ``current_stream()``, ``wait_stream``,
    ``torch.cuda.stream(...)``, ``record_event()`` and ``event.synchronize()`` around the
    device-to-host copies of the split sizes (``torch.cpu.Stream.record_event`` returns None,
    so torch.cpu's classes cannot be used as is).  ``p2p_communication._communicate`` (PP > 1
    with batch_isend_irecv) calls ``torch.cuda.synchronize()``; MoE shared-expert overlap and
    delayed-wgrad use ``torch.cuda.Event``.
    """
    torch.cuda.Stream = _CpuStream
    torch.cuda.Event = _CpuEvent
    torch.cuda.current_stream = _cpu_current_stream
    torch.cuda.default_stream = _cpu_current_stream
    torch.cuda.stream = _cpu_stream_context
    torch.cuda.synchronize = _cpu_synchronize
    return True


@_register("cpu")
def _clip_grad_cpu() -> bool:
    """CPU version of ``megatron/core/optimizer/clip_grads.py:clip_grad_by_total_norm_fp32``.

    Upstream asserts ``param.grad.type() == 'torch.cuda.FloatTensor'`` (an AssertionError
    with no message for every CPU fp32 grad) and allocates a ``device='cuda'`` overflow buffer
    for apex's multi_tensor_scale.  It is called by ``MegatronOptimizer.clip_grad_norm`` (and
    ``ChainedOptimizer``) whenever ``clip_grad > 0`` and the grad norm exceeds it.  The
    replacement keeps the dtype check (fp32 grads; fp32/bf16 decoupled grads) and scales the
    grads in place by ``min(1, max_norm / (total_norm + 1e-6))``.  Patched where the name is
    looked up: ``clip_grads`` and ``optimizer.optimizer`` (which imports it by name).
    """
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as moptimizer
    from megatron.core.utils import to_local_if_dtensor

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        grads = []
        for param in parameters:
            if use_decoupled_grad:
                grad = getattr(param, "decoupled_grad", None)
                if grad is None:
                    continue
                assert grad.dtype in (torch.float32, torch.bfloat16), grad.dtype
            else:
                grad = param.grad
                if grad is None:
                    continue
                assert grad.dtype == torch.float32, f"expected fp32 main grads, got {grad.dtype}"
            grads.append(to_local_if_dtensor(grad).detach())
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if isinstance(clip_coeff, torch.Tensor):
            clip_coeff = clip_coeff.clamp_max(1.0)
        elif clip_coeff >= 1.0:
            return
        if grads:
            torch._foreach_mul_(grads, clip_coeff)

    clip_grad_by_total_norm_fp32.__doc__ = clip_grads.clip_grad_by_total_norm_fp32.__doc__
    clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    moptimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    mimo = sys.modules.get("megatron.core.models.mimo.optimizer")
    if mimo is not None and hasattr(mimo, "clip_grad_by_total_norm_fp32"):
        mimo.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    return True


@_register("cpu")
def _moe_split_sizes_numpy() -> bool:
    """Let ``moe_utils.maybe_move_tensor_to_cpu(..., as_numpy=True)`` convert CPU tensors too.

    ``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize``
    (megatron/core/transformer/moe/token_dispatcher.py) turns ``input_splits``,
    ``output_splits`` and ``output_splits_tp`` into numpy arrays through this helper
    (megatron/core/transformer/moe/moe_utils.py), which only converts CUDA tensors.  On CPU
    they stay torch tensors and, with EP > 1 (or TP > 1 with the alltoall dispatcher),
    ``torch.distributed.all_to_all_single`` in ``tensor_parallel/mappings.py:_AllToAll``
    rejects them ("all_to_all_single(): incompatible function arguments").  Patched in
    ``moe_utils`` and in ``token_dispatcher`` (which imports it by name).
    """
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    upstream = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.detach().numpy().copy()  # a private copy, as the D2H copy gives
        return upstream(tensor, as_numpy=as_numpy, record_stream=record_stream)

    maybe_move_tensor_to_cpu.__doc__ = upstream.__doc__
    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    return True


# --- the TorchFunctionMode shared by cuda_device_redirect and cuda_tensor_type ------------

# Tensor.type() is spoofed only for calls made directly from these modules.
_TYPE_NAME_MODULES = frozenset(
    {"megatron.core.optimizer.optimizer", "megatron.core.optimizer.distrib_optimizer"}
)
# Device literals are redirected only for calls whose nearest non-torch caller is in
# megatron (core or training); the project's own code must stay device-agnostic.
_REDIRECT_PREFIX = "megatron."


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    # A bare ordinal means a CUDA device; bool is an int but never a device.
    return isinstance(device, int) and not isinstance(device, bool)


def _caller_module() -> str:
    """Module name of the nearest frame outside torch and this module."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name != __name__ and name != "torch" and not name.startswith("torch."):
            return name
        frame = frame.f_back
    return ""


_TENSOR_CUDA = torch.Tensor.cuda
_TENSOR_TO = torch.Tensor.to
_TENSOR_PIN_MEMORY = torch.Tensor.pin_memory
_TENSOR_TYPE = torch.Tensor.type


class _CudaLiteralsToCpu(torch.overrides.TorchFunctionMode):
    """Rewrites megatron-core's hard-coded CUDA device literals for a CPU build of torch.

    ``redirect_devices`` (shim cuda_device_redirect), for calls from megatron code only:
    ``device='cuda'``/``'cuda:N'``/ordinal keyword -> ``'cpu'``; ``Tensor.cuda()`` -> the
    tensor itself; ``Tensor.to('cuda', ...)`` -> ``.to('cpu', ...)``; ``pin_memory=True`` ->
    False; ``Tensor.pin_memory()`` -> the tensor itself.
    ``tensor_type_names`` (shim cuda_tensor_type): ``Tensor.type()`` without arguments
    returns the CUDA type name ('torch.cuda.FloatTensor' ...) when called from the
    optimizer modules in ``_TYPE_NAME_MODULES``.
    Every other torch call passes through unchanged.
    """

    def __init__(self):
        super().__init__()
        self.redirect_devices = False
        self.tensor_type_names = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if func is _TENSOR_TYPE:
            if self.tensor_type_names and len(args) == 1 and not kwargs:
                name = func(*args)
                if name.startswith("torch.") and not name.startswith("torch.cuda."):
                    if _caller_module() in _TYPE_NAME_MODULES:
                        return "torch.cuda." + name[len("torch."):]
                return name
        elif self.redirect_devices:
            if func is _TENSOR_CUDA or func is _TENSOR_PIN_MEMORY:
                if _caller_module().startswith(_REDIRECT_PREFIX):
                    return args[0]
            elif (
                _is_cuda_device(kwargs.get("device"))
                or kwargs.get("pin_memory")
                or (func is _TENSOR_TO and len(args) > 1 and _is_cuda_device(args[1]))
            ):
                if _caller_module().startswith(_REDIRECT_PREFIX):
                    kwargs = dict(kwargs)
                    if _is_cuda_device(kwargs.get("device")):
                        kwargs["device"] = "cpu"
                    if kwargs.get("pin_memory"):
                        kwargs["pin_memory"] = False
                    if func is _TENSOR_TO and len(args) > 1 and _is_cuda_device(args[1]):
                        args = (args[0], "cpu") + tuple(args[2:])
        return func(*args, **kwargs)


_MODE: Optional[_CudaLiteralsToCpu] = None


def _cuda_literals_mode() -> _CudaLiteralsToCpu:
    """The process-wide mode, entered (and never exited) on first use."""
    global _MODE
    if _MODE is None:
        _MODE = _CudaLiteralsToCpu()
        _MODE.__enter__()
    return _MODE


@_register("cpu")
def _cuda_device_redirect() -> bool:
    """Redirect megatron-core's literal ``device='cuda'``, ``.cuda()``, ``.to('cuda')`` and
    ``pin_memory`` to the CPU (a TorchFunctionMode, active for calls made from ``megatron.*``
    modules only; every other call, e.g. from this project, is left untouched and fails
    loudly if it names CUDA).

    Call sites reached on CPU (all raise "Torch not compiled with CUDA enabled", or for pinning
    "Cannot access accelerator device when none is available", without it):

    * optimizer: ``grad_scaler`` (Constant/DynamicGradScaler tensors, ``load_state_dict``
      ``.cuda()``), ``MixedPrecisionOptimizer.__init__`` (found_inf, _dummy_overflow_buf,
      _scale_one), ``FP32Optimizer.__init__`` (_scale), ``MegatronOptimizer``'s grad-norm-group
      flag and ``restore_from_cpu``, ``clip_grads.get_grad_norm_fp32`` / ``count_zeros_fp32``,
      ``megatron/core/utils.py:local_multi_tensor_l2_norm`` (the no-apex grad-norm kernel),
      ``DistributedOptimizer.get_parameter_state_dp_zero`` (gloo gather, ``.cuda()``).
    * pipeline schedules: ``forward_backward_no_pipelining``, ``..._pipelining_without_
      interleaving``, ``..._pipelining_with_interleaving`` (``total_num_tokens``).
    * attention: ``fusions/fused_softmax.py`` causal masks from ``transformer/utils.py:
      get_default_causal_mask`` / ``get_sliding_window_causal_mask``.
    * ``models/common/embeddings/rope_utils.py:get_pos_emb_on_this_cp_rank`` (CP > 1;
      ``pin_memory=True`` + ``.cuda(non_blocking=True)``).
    * ``LanguageModule.setup_embeddings_and_output_layer`` (PP > 1 tied embeddings).
    * ``tensor_parallel/data.py:broadcast_data``; ``rerun_state_machine._reduce_any``;
      ``utils.check_param_hashes_across_dp_replicas``.
    * dist_checkpointing: ``strategies/state_dict_saver.verify_global_md_reuse``,
      ``exchange_utils`` (fully-parallel load/save exchange: ``init_data("cuda")``,
      ``empty_like(device="cuda")``, ``.cuda()``).
    * ``distributed/param_and_grad_buffer.py`` ``offload_to_cpu`` (``pin_memory()``).

    The mode is pushed on the torch-function-mode stack of the thread that applies the shims;
    other threads do not see it, and torch's autograd engine empties that stack while it runs
    backward functions and hooks.  Megatron's activation recomputation re-runs forward code
    (e.g. the causal mask above) inside backward, so ``tensor_parallel/random.py``'s
    ``CheckpointFunction.backward`` and ``CheckpointWithoutOutput._recompute`` are wrapped to
    re-enter the mode.
    """
    from megatron.core.tensor_parallel import random as mrandom

    _cuda_literals_mode().redirect_devices = True
    ckpt = mrandom.CheckpointFunction
    ckpt.backward = staticmethod(_in_cuda_literals_mode(ckpt.backward))
    no_out = mrandom.CheckpointWithoutOutput
    no_out._recompute = _in_cuda_literals_mode(no_out._recompute)
    return True


def _in_cuda_literals_mode(fn):
    """Wrap ``fn`` to run with the mode on the stack (autograd's backward runs without it)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _MODE is None or _MODE in torch.overrides._get_current_function_mode_stack():
            return fn(*args, **kwargs)
        with _MODE:
            return fn(*args, **kwargs)

    return wrapper


@_register("cpu")
def _cuda_tensor_type() -> bool:
    """Make ``Tensor.type()`` report CUDA type names inside megatron's optimizer modules.

    ``Float16OptimizerWithFloat16Params.__init__`` (optimizer/optimizer.py) and
    ``DistributedOptimizer._build_model_and_main_param_groups`` (optimizer/distrib_optimizer.py)
    dispatch on ``param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']`` /
    ``== 'torch.cuda.FloatTensor'`` and raise TypeError "Wrapped parameters must be one of
    torch.cuda.FloatTensor, torch.cuda.HalfTensor, or torch.cuda.BFloat16Tensor" for CPU
    params.  The spoof applies only to argument-less ``type()`` calls made directly from
    those two modules; ``clip_grads`` has its own shim (clip_grad_cpu).
    """
    _cuda_literals_mode().tensor_type_names = True
    return True


def apply_cpu_shims() -> List[str]:
    """Apply the runtime shims megatron-core needs on a CPU-only torch.  Idempotent.

    No-op when CUDA is available.  Applies the pre-import shims first (harmless if they
    already ran), so it may be called before or after ``import megatron.core``.
    Returns ``APPLIED``.
    """
    apply_pre_import_shims()
    if not HAS_CUDA:
        _apply(CPU_SHIMS)
    return APPLIED


# ---------------------------------------------------------------------------------------
# Process group + megatron parallel state
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ParallelSizes:
    """Model-parallel layout set up by :func:`initialize_model_parallel`."""

    tp: int
    pp: int
    ep: int
    etp: int
    cp: int
    vpp: Optional[int]
    dp: int
    world_size: int


_OWNS_PROCESS_GROUP = False
_STORE = None  # keeps the single-process TCPStore alive


def _check_positive(flag: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"--{flag} must be a positive integer, got {value!r}")


def _validate_sizes(world_size, tp, pp, ep, etp, cp, vpp) -> ParallelSizes:
    for flag, value in (("tp", tp), ("pp", pp), ("ep", ep), ("cp", cp)):
        _check_positive(flag, value)
    if etp is not None:
        _check_positive("etp", etp)
    if vpp is not None:
        _check_positive("vpp", vpp)
    etp_eff = tp if etp is None else etp
    for flag, value in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep), ("etp", etp_eff)):
        if world_size % value:
            raise ValueError(f"--{flag} {value} does not divide world size {world_size}")
    if world_size % (tp * pp * cp):
        raise ValueError(
            f"--tp {tp} x --pp {pp} x --cp {cp} = {tp * pp * cp} does not divide "
            f"world size {world_size}"
        )
    if world_size % (etp_eff * ep * pp):
        raise ValueError(
            f"--etp {etp_eff} x --ep {ep} x --pp {pp} = {etp_eff * ep * pp} does not divide "
            f"world size {world_size}"
        )
    if vpp is not None and pp == 1:
        raise ValueError(f"--vpp {vpp} needs --pp > 1 (interleaved pipeline schedule)")
    return ParallelSizes(tp, pp, ep, etp_eff, cp, vpp, world_size // (tp * pp * cp), world_size)


def _launcher_env() -> bool:
    return all(k in os.environ for k in ("WORLD_SIZE", "RANK", "MASTER_ADDR"))


def _expected_world_size() -> int:
    if torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    if _launcher_env():
        return int(os.environ["WORLD_SIZE"])
    return 1


def _init_process_group(backend: Optional[str]) -> None:
    global _OWNS_PROCESS_GROUP, _STORE
    dist = torch.distributed
    if dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if HAS_CUDA else "gloo"
    if HAS_CUDA:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if _launcher_env():
        dist.init_process_group(backend=backend, init_method="env://")
    else:
        # Port 0: the store binds a free port itself (no find-then-bind race).
        _STORE = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True)
        dist.init_process_group(backend=backend, store=_STORE, world_size=1, rank=0)
    _OWNS_PROCESS_GROUP = True


def _current_sizes(ps) -> ParallelSizes:
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    cp = ps.get_context_parallel_world_size()
    world = torch.distributed.get_world_size()
    return ParallelSizes(
        tp=tp,
        pp=pp,
        ep=ps.get_expert_model_parallel_world_size(),
        etp=ps.get_expert_tensor_parallel_world_size(),
        cp=cp,
        vpp=ps.get_virtual_pipeline_model_parallel_world_size(),
        dp=world // (tp * pp * cp),
        world_size=world,
    )


def initialize_model_parallel(
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: Optional[int] = None,
    cp: int = 1,
    vpp: Optional[int] = None,
    seed: int = 1234,
    backend: Optional[str] = None,
) -> ParallelSizes:
    """Set up torch.distributed + megatron parallel state + RNG in one call.

    * Process group, if none exists: ``env://`` when WORLD_SIZE/RANK/MASTER_ADDR are set
      (torchrun), else a single process (world size 1, rank 0) on a free localhost TCP port.
      Backend: ``backend`` or gloo without CUDA / nccl with CUDA (the CUDA device is set from
      LOCAL_RANK).
    * :func:`apply_cpu_shims` (no-op with CUDA).
    * ``parallel_state.initialize_model_parallel`` with the sizes; skipped when already
      initialized with the same sizes, destroyed and re-initialized when they differ.
    * RNG: ``torch.manual_seed(seed)`` + ``model_parallel_cuda_manual_seed(seed)``, on every
      call.

    ``etp=None`` means etp = tp (megatron's default).  Raises ValueError naming the flag
    (e.g. "--tp 3 does not divide world size 4") before anything is initialized.
    """
    apply_pre_import_shims()
    sizes = _validate_sizes(_expected_world_size(), tp, pp, ep, etp, cp, vpp)
    _init_process_group(backend)
    if torch.distributed.get_world_size() != sizes.world_size:  # WORLD_SIZE env disagreed
        sizes = _validate_sizes(torch.distributed.get_world_size(), tp, pp, ep, etp, cp, vpp)
    apply_cpu_shims()

    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.model_parallel_is_initialized():
        if _current_sizes(parallel_state) == sizes:
            torch.manual_seed(seed)
            tensor_parallel.model_parallel_cuda_manual_seed(seed)
            return sizes
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=sizes.etp,
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return sizes


def destroy_model_parallel() -> None:
    """Tear down megatron parallel state, and the process group if this module created it."""
    global _OWNS_PROCESS_GROUP, _STORE
    if "megatron.core.parallel_state" in sys.modules:
        sys.modules["megatron.core.parallel_state"].destroy_model_parallel()
    if _OWNS_PROCESS_GROUP and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    _OWNS_PROCESS_GROUP = False
    _STORE = None
