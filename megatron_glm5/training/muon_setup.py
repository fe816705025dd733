"""``--optimizer muon``: its flags, their checks, and the optimizer built through megatron-core's factory.

megatron-core 0.19.2 builds Muon in ``get_megatron_optimizer`` (``optimizer/__init__.py``,
``_get_megatron_emerging_optimizer``): it routes embeddings, the output head and every non-2-D parameter to Adam,
wraps the rest in its bf16/fp32 optimizer wrappers and, with ``use_layer_wise_distributed_optimizer``, shards whole
parameters over the data-parallel ranks (``LayerWiseDistributedOptimizer``). The optimizer class itself comes from
the ``emerging-optimizers`` package, which needs Python >= 3.12 (it imports ``typing.override``; installed on 3.11
it breaks ``import megatron.core``). So the registry entry ``muon`` is pointed at :class:`GLM5Muon`
(training/muon.py) for the duration of the build; everything else is megatron-core's.
"""
from __future__ import annotations

import contextlib
import copy
import functools

import torch

from megatron_glm5.training.muon import GLM5Muon, split_of


def is_muon(optimizer) -> bool:
    return isinstance(optimizer, GLM5Muon)


def _tag(model_chunks, split_heads: bool) -> None:
    for chunk in model_chunks:
        config = chunk.config
        for name, p in chunk.named_parameters():
            if p.requires_grad:
                p.muon_split = split_of(name, p, config, split_heads)


def _takes_muon(param) -> bool:
    """megatron-core's rule (2-D, not embedding / output head) plus GLM-5's grouped experts ([E, ...], split per
    expert)."""
    if getattr(param, "is_embedding_or_output_parameter", False):
        return False
    return param.dim() == 2 or getattr(param, "muon_split", None) is not None


@contextlib.contextmanager
def _registered(args):
    import megatron.core.optimizer as mcore_opt
    from megatron.core.optimizer import emerging_optimizers as eo
    from megatron.core.optimizer.optimizer_config import ParamKey, ParamPredicate

    def kwargs(config, model_chunks, pg_collection):
        tp, etp = pg_collection.tp, getattr(pg_collection, "expt_tp", None)
        return dict(lr=config.lr, momentum=args.muon_momentum, nesterov=args.muon_nesterov,
                    weight_decay=config.weight_decay, num_ns_steps=args.muon_ns_steps,
                    scale_mode=args.muon_scale_mode, matched_adamw_rms=args.muon_matched_adamw_rms,
                    extra_scale_factor=args.muon_extra_scale_factor,
                    tp_group_of=lambda p: etp if getattr(p, "expert_tp", False) else tp)

    entry = eo.EmergingOptimizerEntry(
        optimizer_cls=GLM5Muon, init_state_fn=lambda opt, config=None: init_torch_state(opt), config_to_kwargs=kwargs,
        default_param_overrides={ParamKey(predicate=ParamPredicate(name="glm5_not_muon",
                                                                   fn=lambda p: not _takes_muon(p))):
                                 {"optimizer": "adam"}})
    saved = (eo._EMERGING_OPTIMIZERS.get("muon"), mcore_opt.HAVE_EMERGING_OPTIMIZERS)
    eo._EMERGING_OPTIMIZERS["muon"] = entry
    mcore_opt.HAVE_EMERGING_OPTIMIZERS = True
    try:
        yield
    finally:
        if saved[0] is None:
            eo._EMERGING_OPTIMIZERS.pop("muon", None)
        else:
            eo._EMERGING_OPTIMIZERS["muon"] = saved[0]
        mcore_opt.HAVE_EMERGING_OPTIMIZERS = saved[1]


def leaf_optimizers(optimizer):
    """The megatron-core optimizers a (possibly nested: Muon's layer-wise one) ChainedOptimizer holds."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(opt, "chained_optimizers"):
            yield from leaf_optimizers(opt)
        else:
            yield opt


def init_torch_state(inner) -> None:
    """Give every parameter of a torch optimizer (GLM5Muon or torch's Adam) its zero state, as a checkpoint load
    needs it before the first step."""
    if isinstance(inner, GLM5Muon):
        inner.init_state()
        return
    for group in inner.param_groups:
        for p in group["params"]:
            st = inner.state[p]
            if not st:
                st["step"] = torch.tensor(0.0)
                st["exp_avg"] = torch.zeros_like(p.data)
                st["exp_avg_sq"] = torch.zeros_like(p.data)


def _layer_wise_fp32_class():
    from megatron.core.optimizer.optimizer import FP32Optimizer

    class LayerWiseFP32Optimizer(FP32Optimizer):
        """FP32Optimizer with its sharded state dict under "optimizer", the layout LayerWiseDistributedOptimizer's
        sharded_state_dict reads (it was written for Float16OptimizerWithFloat16Params)."""

        def load_state_dict(self, state_dict):
            super().load_state_dict(state_dict["optimizer"] if "state" not in state_dict else state_dict)

        def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, metadata=None):
            return {"optimizer": super().sharded_state_dict(model_sharded_state_dict, is_loading, metadata)}

    return LayerWiseFP32Optimizer


def _wrap_fp32(layer_wise, cfg) -> None:
    """megatron-core 0.19.2's LayerWiseDistributedOptimizer wraps its torch optimizers for bf16 only (with fp32
    parameters they stay raw torch optimizers, which its ChainedOptimizer steps cannot drive): wrap them as the
    plain fp32 path does."""
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    cls = _layer_wise_fp32_class()
    wrapped = [o if isinstance(o, MegatronOptimizer) else cls(o, cfg, lambda opt, config=None: init_torch_state(opt))
               for o in layer_wise.chained_optimizers]
    layer_wise.chained_optimizers = wrapped
    layer_wise.config = cfg
    layer_wise.is_stub_optimizer = all(getattr(o, "is_stub_optimizer", False) for o in wrapped)


def _padded_allgather_params(layer_wise) -> None:
    """LayerWiseDistributedOptimizer.allgather_params for gloo: its all_gather of uneven per-rank sizes is NCCL's
    (gloo refuses it), so each rank's flat parameters are padded to the largest size."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    for params_list, group in ((layer_wise.dp_cp_params_list, layer_wise.dp_cp),
                               (layer_wise.expt_dp_params_list, layer_wise.expt_dp)):
        if not params_list:
            continue
        rank = torch.distributed.get_rank(group)
        sizes = [sum(p.numel() for p in params) for params in params_list]
        if max(sizes) == 0:
            continue
        some = next(p for params in params_list for p in params)
        src = torch.zeros(max(sizes), dtype=some.dtype, device=some.device)
        if params_list[rank]:
            src[:sizes[rank]] = _flatten_dense_tensors([p.data for p in params_list[rank]])
        gathered = [torch.empty_like(src) for _ in params_list]
        torch.distributed.all_gather(gathered, src, group=group)
        for i, params in enumerate(params_list):
            if i == rank or not params:
                continue
            for new, p in zip(_unflatten_dense_tensors(gathered[i][:sizes[i]], params), params):
                p.data.copy_(new)


def _tag_main_params(optimizer) -> None:
    """megatron-core's bf16 optimizers step fp32 copies of the parameters, which carry the tensor-parallel
    attributes but not ours: give each copy its parameter's split (and megatron-core's expert_tp tag)."""
    for opt in leaf_optimizers(optimizer):
        for params, mains in zip(getattr(opt, "float16_groups", []), getattr(opt, "fp32_from_float16_groups", [])):
            for p, main in zip(params, mains):
                main.muon_split = getattr(p, "muon_split", None)
                main.expert_tp = getattr(p, "expert_tp", False)


def build(args, cfg, model_chunks):
    """megatron-core's Muon chain for ``cfg`` (an OptimizerConfig with optimizer="muon")."""
    from megatron.core.optimizer import get_megatron_optimizer

    _tag(model_chunks, args.muon_split_heads)
    cfg = copy.copy(cfg)
    cfg.use_layer_wise_distributed_optimizer = bool(args.use_distributed_optimizer)
    cfg.use_distributed_optimizer = False  # the Adam part is sharded inside the layer-wise optimizer
    with _registered(args):
        optimizer = get_megatron_optimizer(cfg, model_chunks)
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer

    for opt in [optimizer, *getattr(optimizer, "chained_optimizers", [])]:
        if not isinstance(opt, LayerWiseDistributedOptimizer):
            continue
        if not cfg.bf16:
            _wrap_fp32(opt, cfg)
        if opt.dp_cp is not None and torch.distributed.get_backend(opt.dp_cp) == "gloo":
            opt.allgather_params = functools.partial(_padded_allgather_params, opt)
    _tag_main_params(optimizer)
    return optimizer
