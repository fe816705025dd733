"""Helper of tests/test_layouts_cpu.py (launched with torchrun; not a test module itself).

One training forward/backward of the tiny GLM-5 model (2 micro-batches through megatron-core's pipeline schedule,
DistributedDataParallel and finalize_model_grads, exactly as the trainer configures them) at the layout given by
the flags, from the weights in ``--weights`` (a dist_checkpointing directory; written first when it does not exist,
by a one-process run). Every rank writes ``<out>/<variant>.rank<R>.pt``: {global parameter name: full gradient},
the shards of tensor-, expert- and pipeline-parallel parameters gathered back into the single-process shape.

Variants (``--variants``), each a fresh forward/backward on the same model and batch:
  ok                the code as it is;
  krope_unsummed    the shared RoPE key's gradient is not summed over TP ranks (what megatron-core's own non-TE
                    MLASelfAttention does): GLM5MLASelfAttention's copy_to_tensor_model_parallel_region then only
                    covers the latent part of the [latent | k_rope] key;
  qnorm_tp_summed   q_layernorm's weight loses ``average_gradients_across_tp_domain``, so finalize_model_grads
                    sums its (already complete) gradient over TP by name, as before the fix.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

SEQ, MBS, MICRO_BATCHES = 64, 2, 2


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--weights", required=True)
    p.add_argument("--variants", default="ok")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--etp", type=int, default=1)
    return p.parse_args()


def build(opts):
    """The model of this rank's pipeline stage, configured as the trainer configures it, wrapped in DDP."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from megatron_glm5 import platform
    from megatron_glm5.arguments import args_to_overrides, parse_args, validate_args
    from megatron_glm5.model.model import build_model

    argv = ["--preset", opts.preset, "--tp", str(opts.tp), "--pp", str(opts.pp), "--ep", str(opts.ep),
            "--etp", str(opts.etp), "--micro-batch-size", str(MBS), "--seq-length", str(SEQ),
            "--global-batch-size", str(MBS * MICRO_BATCHES * (dist.get_world_size() // (opts.tp * opts.pp))),
            "--attn", "torch", "--no-save"]
    args = validate_args(parse_args(argv, mode="finetune"), world_size=dist.get_world_size())
    platform.initialize_model_parallel(tp=opts.tp, pp=opts.pp, ep=opts.ep, etp=opts.etp, seed=1234)
    model = build_model(args.model_config, **args_to_overrides(args))
    ddp = DistributedDataParallel(
        config=model.config, module=model,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, check_for_nan_in_grad=False))
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.no_sync_func = ddp.no_sync
    return model, ddp


def batches():
    """MICRO_BATCHES fixed micro-batches (the same on every rank: the layouts under test have one DP rank)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(MICRO_BATCHES):
        ids = torch.randint(1, 512, (MBS, SEQ + 1), generator=g)
        out.append({"tokens": ids[:, :-1], "labels": ids[:, 1:],
                    "position_ids": torch.arange(SEQ).expand(MBS, SEQ).contiguous(),
                    "loss_mask": torch.ones(MBS, SEQ)})
    return out


def forward_backward(model, ddp):
    from functools import partial

    from megatron.core.pipeline_parallel import get_forward_backward_func

    def loss_func(mask, output):
        loss = (output.float().view(-1) * mask.view(-1)).sum()
        n = mask.sum().to(torch.int)
        return loss, n, {"lm loss": torch.stack([loss.detach(), n.detach().float()])}

    def step(it, m):
        b = next(it)
        out = m(b["tokens"], b["position_ids"], None, labels=b["labels"], loss_mask=b["loss_mask"])
        return out, partial(loss_func, b["loss_mask"])

    ddp.zero_grad_buffer()
    get_forward_backward_func()(forward_step_func=step, data_iterator=iter(batches()), model=[ddp],
                                num_microbatches=MICRO_BATCHES, seq_length=SEQ, micro_batch_size=MBS,
                                forward_only=False)


def _gather(t: torch.Tensor, group, dim: int) -> torch.Tensor:
    if group is None or group.size() == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(group.size())]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def full_grads(model) -> dict:
    """{global name: gradient in the single-process shape} for this rank's parameters."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    tp, ep, etp = (ps.get_tensor_model_parallel_group(), ps.get_expert_model_parallel_group(),
                   ps.get_expert_tensor_parallel_group())
    offset = get_transformer_layer_offset(model.config) if ps.get_pipeline_model_parallel_world_size() > 1 else 0
    out = {}
    for name, p in model.named_parameters():
        g = p.main_grad.detach().clone()
        if ".experts.weight" in name:  # [E_local, ...]: experts over EP (axis 0), their width over ETP
            if getattr(p, "tensor_model_parallel", False):
                g = _gather(g, etp, p.partition_dim)
            g = _gather(g, ep, 0)
        elif getattr(p, "tensor_model_parallel", False):
            if name.endswith("linear_fc1.weight") and tp.size() > 1:
                # gated MLP: each rank holds [gate_r | up_r]; the full weight is [gate | up]
                gate, up = g.chunk(2, dim=0)
                g = torch.cat([_gather(gate, tp, 0), _gather(up, tp, 0)], dim=0)
            else:
                g = _gather(g, tp, p.partition_dim)
        if offset and name.startswith("decoder.layers."):
            i, rest = name[len("decoder.layers."):].split(".", 1)
            name = f"decoder.layers.{int(i) + offset}.{rest}"
        out[name] = g
    return out


class _KRopeUnsummed:
    """Inside GLM5MLASelfAttention, sum only the latent part of the [latent | k_rope] key's gradient over TP."""

    def __init__(self, cfg):
        self.lat, self.width = cfg.kv_lora_rank, cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim

    def __enter__(self):
        from megatron_glm5.model import mla

        self.orig = orig = mla.copy_to_tensor_model_parallel_region
        lat, width = self.lat, self.width

        def copy_to(t, group=None):
            if t.shape[-1] == width:  # the key: latent reduced (as linear_kv_up_proj does upstream), k_rope not
                return torch.cat([orig(t[..., :lat], group=group), t[..., lat:]], dim=-1)
            return orig(t, group=group)
        mla.copy_to_tensor_model_parallel_region = copy_to
        return self

    def __exit__(self, *exc):
        from megatron_glm5.model import mla
        mla.copy_to_tensor_model_parallel_region = self.orig


class _QNormTPSummed:
    def __init__(self, model):
        self.weights = [p for n, p in model.named_parameters() if n.endswith("q_layernorm.weight")]

    def __enter__(self):
        for w in self.weights:
            del w.average_gradients_across_tp_domain
        return self

    def __exit__(self, *exc):
        for w in self.weights:
            w.average_gradients_across_tp_domain = True


def main():
    opts = parse()
    from megatron_glm5 import platform
    platform.apply_pre_import_shims()
    dist.init_process_group("gloo")
    from megatron.core import dist_checkpointing

    model, ddp = build(opts)
    if not os.path.isdir(opts.weights):
        if dist.get_world_size() != 1:
            sys.exit(f"{opts.weights} does not exist: write it with a one-process run first")
        os.makedirs(opts.weights)
        dist_checkpointing.save(model.sharded_state_dict(), opts.weights)
    else:
        result = model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), opts.weights), strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        assert not missing, f"{opts.weights} lacks {missing}"
    model.train()
    os.makedirs(opts.out, exist_ok=True)
    # finalize_model_grads updates the routers' expert bias: every variant starts from the loaded state
    initial = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    for variant in opts.variants.split(","):
        model.load_state_dict(initial, strict=False)
        patch = {"ok": None, "krope_unsummed": lambda: _KRopeUnsummed(model.config),
                 "qnorm_tp_summed": lambda: _QNormTPSummed(model)}[variant]
        if patch is None:
            forward_backward(model, ddp)
        else:
            with patch():
                forward_backward(model, ddp)
        torch.save(full_grads(model), os.path.join(opts.out, f"{variant}.rank{dist.get_rank()}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
