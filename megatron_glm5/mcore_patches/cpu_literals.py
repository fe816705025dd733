"""CPU-only patches: megatron-core's hard-coded CUDA device literals and CUDA tensor-type checks, redirected by
one TorchFunctionMode for calls made from megatron code only."""
from __future__ import annotations

import functools
import sys
from typing import Optional

import torch

from megatron_glm5.mcore_patches.record import Patch, Phase


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


PATCHES = (
    Patch(
        name='cuda_device_redirect',
        site="device='cuda', .cuda(), .to('cuda'), pin_memory in megatron/core",
        why='optimizer, schedules, broadcast_data, dist_checkpointing ... name CUDA devices literally',
        test='tests/test_platform.py::test_shim_is_needed[cuda_device_redirect]',
        phase=Phase.CPU, apply=_cuda_device_redirect),
    Patch(
        name='cuda_tensor_type',
        site='megatron/core/optimizer/optimizer.py, distrib_optimizer.py param.type()',
        why='the bf16/fp16 optimizers accept only torch.cuda.*Tensor parameters',
        test='tests/test_platform.py::test_shim_is_needed[cuda_tensor_type]',
        phase=Phase.CPU, apply=_cuda_tensor_type),
)
