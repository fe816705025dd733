"""Decoding over a tensor/pipeline/expert-parallel layout: ``torchrun --nproc-per-node N tools/generate.py --tp T
--pp P --ep E --load DIR ...``.

Everything but the decode loop is the training scripts' own: the layout flags are the training parser's actions
(``add_flags``), checked by ``arguments.validate_args`` for this world size (``check``); the process group and
parallel state come from ``platform.initialize_model_parallel`` (nccl on a GPU, gloo on CPU), the model chunk
from ``training.loop.build_model_chunks`` and the weights from ``training.checkpointing.load_checkpoint`` (weights
only, as with --finetune: a checkpoint saved at any layout, or a converted one, is resharded by megatron-core's
dist-checkpointing) (``load_model``).

How a step runs (``Stage`` is what decode.py and perplexity.py call):
- TP: each rank holds its heads, its vocabulary shard and its expert shards; sequence parallelism is off (one new
  token per row cannot be split over the ranks), so every TP rank runs the whole batch; the latent cache is
  replicated (it is not per head); the output layer gathers the logits over the vocabulary.
- PP: each stage caches only its own layers (under their global layer numbers); the hidden states [s, b, H] go
  stage to stage with torch.distributed send/recv on the pipeline group. The receiver knows the shape (every rank
  decodes the same tokens), so no shape is exchanged; megatron-core's p2p helpers are built for the training
  schedules (fixed tensor shapes, gradients both ways) and are not used. IndexShare across a stage boundary is
  training's: GLM5TransformerBlock.forward receives the top-k of the source layer from the previous stage
  (model/pipeline_topk.py); the sends are waited after each hidden-state send.
- EP (and data-parallel replicas): every rank runs the same batch, so every MoE all-to-all has all its ranks.
- The next token is decided on one rank, the lead (the first rank of the last pipeline stage with tensor-parallel
  rank 0), and broadcast to every rank: a seeded sampler draws exactly as one process does. The lead alone prints.
"""
from __future__ import annotations

import logging
import os
import warnings
from typing import Optional

import torch
import torch.distributed as dist

from megatron_glm5.arguments import ArgumentError

# the training parser's layout flags that tools/generate.py accepts (same names, types, defaults and checks)
LAYOUT_DESTS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                "expert_model_parallel_size", "expert_tensor_parallel_size", "context_parallel_size",
                "sequence_parallel", "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
SCRIPT = "tools/generate.py"


class ParallelDecodeError(ArgumentError):
    """A layout or flag combination that parallel decoding cannot run (rank 0 alone reports it under torchrun)."""


def add_flags(parser) -> None:
    """The training scripts' layout flags (megatron_glm5/arguments.py's "parallelism" group), as its actions."""
    from megatron_glm5.arguments import build_parser

    group = parser.add_argument_group(
        "parallel layout (under torchrun; the training scripts' flags)",
        "decoding runs without sequence parallelism and refuses --sequence-parallel, --cp > 1 and --vpp")
    for action in build_parser("finetune")._actions:  # noqa: SLF001 - the same actions, not copies of them
        if action.dest in LAYOUT_DESTS:
            group._add_action(action)  # noqa: SLF001


def world_size() -> int:
    env = os.environ.get("WORLD_SIZE", "1")
    return int(env) if env.isdigit() and int(env) > 0 else 1


def requested(args, world: int) -> bool:
    """Parallel decoding: more than one process, or a layout flag other than one process's."""
    sizes = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size,
             args.expert_tensor_parallel_size or 1, args.context_parallel_size,
             args.virtual_pipeline_model_parallel_size or 1)
    return (world > 1 or max(sizes) > 1 or bool(args.sequence_parallel)
            or args.decoder_first_pipeline_num_layers is not None or args.decoder_last_pipeline_num_layers is not None)


def check_flags(args, world: int) -> None:
    """What decoding refuses before anything is loaded (the layout itself is training's check, in ``check``)."""
    if args.hf_dir is not None:
        raise ParallelDecodeError(
            f"--hf-dir runs in one process (WORLD_SIZE={world}): under torchrun give --load a Megatron checkpoint "
            "(convert the directory with tools/convert_hf_to_megatron.py), or launch with python", flag="--hf-dir")
    if args.context_parallel_size > 1:
        raise ParallelDecodeError(
            f"--cp {args.context_parallel_size}: decoding runs without context parallelism (each step is one new "
            "token per row, which cannot be split over ranks); leave --cp out", flag="--cp")
    if args.sequence_parallel:
        raise ParallelDecodeError(
            "--sequence-parallel: decoding runs without it (one new token per row cannot be split over the "
            "tensor-parallel ranks); leave it out", flag="--sequence-parallel")
    if args.virtual_pipeline_model_parallel_size not in (None, 1):
        raise ParallelDecodeError(
            f"--vpp {args.virtual_pipeline_model_parallel_size}: decoding runs one model chunk per pipeline stage; "
            "leave --vpp out (the checkpoint loads at any layout)", flag="--vpp")
    if args.device == "cpu" and torch.cuda.is_available():
        raise ParallelDecodeError("--device cpu under torchrun with a GPU visible: ranks use their GPU (LOCAL_RANK), "
                                  "as the training scripts do; leave --device out or hide the GPUs "
                                  "(CUDA_VISIBLE_DEVICES=)", flag="--device")


def check(args, world: int):
    """The training scripts' namespace for this layout, checked by ``arguments.validate_args`` for ``world``
    ranks (e.g. "world size 2 is not divisible by --tp 4 ..."), set up for decoding: sequence parallelism off,
    no MTP layer, --dtype and --attn applied."""
    from megatron_glm5.arguments import parse_args, validate_args

    targs = parse_args(["--load", args.load, "--finetune", "--no-save"], mode="finetune")
    for dest in LAYOUT_DESTS:
        if dest != "sequence_parallel":  # the training default (on with --tp > 1) for its checks; off below
            setattr(targs, dest, getattr(args, dest))
    targs.launch_script = SCRIPT  # the torchrun hint of a layout error names this tool
    quiet = logging.getLogger("megatron_glm5.arguments")  # its notes are about training (micro-batches per step...)
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        validate_args(targs, world_size=world)
    finally:
        quiet.setLevel(level)
    targs.sequence_parallel = False
    targs.mtp = False
    targs.attn = args.attn
    targs.params_dtype = _dtype(args)
    targs.bf16 = targs.params_dtype == torch.bfloat16
    return targs


def _dtype(args) -> torch.dtype:
    name = args.dtype or ("bf16" if torch.cuda.is_available() else "fp32")
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def load_model(targs):
    """(model chunk of this rank in eval mode, its Stage): the training scripts' process group, model builder and
    checkpoint loading (weights only)."""
    from megatron_glm5 import platform
    from megatron_glm5.training import checkpointing
    from megatron_glm5.training.loop import build_model_chunks

    platform.initialize_model_parallel(
        tp=targs.tensor_model_parallel_size, pp=targs.pipeline_model_parallel_size,
        ep=targs.expert_model_parallel_size, etp=targs.expert_tensor_parallel_size, cp=1, vpp=None,
        seed=targs.seed, timeout_minutes=targs.distributed_timeout_minutes)
    # megatron-core's hint for tensor parallelism without sequence parallelism (set CUDA_DEVICE_MAX_CONNECTIONS for
    # the input-gradient all-reduce) is about a backward pass, which decoding never runs
    warnings.filterwarnings("ignore", message="When using async grad allreduce", category=UserWarning,
                            module=r"megatron\.core")
    chunks = build_model_chunks(targs)
    checkpointing.load_checkpoint(targs.load, chunks, None, None, targs)
    model = chunks[0].eval()
    model.glm5_config = targs.model_config  # eos ids and max positions (decode.py, cli.py)
    return model, Stage(model)


class Stage:
    """This rank's place in the layout, for the decode loop: hidden states from / to the neighbouring pipeline
    stages, and the tokens (or numbers) the lead rank decides, broadcast to every rank."""

    def __init__(self, model):
        from megatron.core import parallel_state as ps

        self.pre_process, self.post_process = bool(model.pre_process), bool(model.post_process)
        self.group = ps.get_pipeline_model_parallel_group()
        self.prev = None if self.pre_process else ps.get_pipeline_model_parallel_prev_rank()
        self.next = None if self.post_process else ps.get_pipeline_model_parallel_next_rank()
        cfg = model.config
        self.hidden_size, self.dtype = int(cfg.hidden_size), cfg.params_dtype
        self.device = next(model.parameters()).device
        rank, world = dist.get_rank(), dist.get_world_size()
        candidate = rank if self.post_process and ps.get_tensor_model_parallel_rank() == 0 else world
        lead = torch.tensor([candidate], dtype=torch.int64, device=self.device)
        dist.all_reduce(lead, op=dist.ReduceOp.MIN)
        self.lead = int(lead.item())
        self.is_lead = rank == self.lead

    def recv_hidden(self, seq: int, batch: int) -> torch.Tensor:
        """The previous stage's output [seq, batch, hidden] for this forward."""
        hidden = torch.empty(seq, batch, self.hidden_size, dtype=self.dtype, device=self.device)
        dist.recv(hidden, src=self.prev, group=self.group)
        return hidden

    def send_hidden(self, hidden: torch.Tensor) -> None:
        """This stage's output to the next stage; then the IndexShare top-k sent in the same forward are waited
        (the next stage receives them right after the hidden states)."""
        from megatron_glm5.model import pipeline_topk

        dist.send(hidden.to(self.dtype).contiguous(), dst=self.next, group=self.group)
        pipeline_topk.wait_pending_sends()

    def share(self, value: Optional[torch.Tensor], shape, dtype) -> torch.Tensor:
        """The lead's ``value`` on every rank (others pass None)."""
        buf = value.to(device=self.device, dtype=dtype).contiguous() if self.is_lead else torch.empty(
            shape, dtype=dtype, device=self.device)
        dist.broadcast(buf, src=self.lead)
        return buf
