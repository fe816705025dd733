"""Optimizer and learning-rate schedule: megatron-core's, configured from the flags."""
from __future__ import annotations

import torch
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_glm5.training import memory_options


def build_optimizer(args, model_chunks):
    cfg = OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        clip_grad=args.clip_grad, bf16=args.bf16, fp16=False, params_dtype=args.params_dtype,
        use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_param_gather=args.overlap_param_gather, **memory_options.optimizer_config_values(args),
    )
    if args.optimizer == "muon":
        from megatron_glm5.training import muon_setup
        return muon_setup.build(args, cfg, model_chunks)
    return get_megatron_optimizer(cfg, model_chunks)


def _schedule_steps(args) -> dict:
    """The schedule's lengths in samples (the flags give them in iterations of --global-batch-size samples)."""
    gbs = args.global_batch_size
    wsd = args.lr_decay_style == "WSD" and args.lr_wsd_decay_iters
    return dict(lr_warmup_steps=args.lr_warmup_iters * gbs, lr_decay_steps=args.lr_decay_iters * gbs,
                wd_incr_steps=args.train_iters * gbs, wsd_decay_steps=args.lr_wsd_decay_iters * gbs if wsd else None)


def build_scheduler(args, optimizer) -> OptimizerParamScheduler:
    """Steps are counted in samples (megatron-core's convention): scheduler.step(global_batch_size) per iteration."""
    style = {"WSD": "WSD"}.get(args.lr_decay_style, args.lr_decay_style)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_decay_style=style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=not args.override_opt_param_scheduler,
        override_opt_param_scheduler=bool(args.override_opt_param_scheduler),
        lr_wsd_decay_style=getattr(args, "lr_wsd_decay_style", None) if style == "WSD" else None,
        **_schedule_steps(args),
    )


def rescale_scheduler(scheduler: OptimizerParamScheduler, args) -> None:
    """After --global-batch-size changed (a resume taking the checkpoint's): the schedule's lengths in samples
    for the new batch, before the checkpoint's schedule state is loaded over them."""
    for name, value in _schedule_steps(args).items():
        setattr(scheduler, name, value)


def ensure_optimizer_state(optimizer) -> None:
    """Give every parameter its (zero) optimizer state before loading a checkpoint into it.

    Without TE/Apex, megatron-core's optimizers build the sharded optimizer state dict from torch Adam's state,
    which is empty before the first step; loading would then find nothing to fill. Muon's: one momentum buffer.
    """
    from megatron_glm5.training.muon_setup import init_torch_state, leaf_optimizers

    for opt in leaf_optimizers(optimizer):
        init_torch_state(opt.optimizer)
