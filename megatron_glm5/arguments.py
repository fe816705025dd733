"""Command-line flags of ``pretrain_glm5.py`` and ``finetune_glm5.py``.

Flags use Megatron-LM's long names (``--tensor-model-parallel-size``; the namespace attribute is the name with
underscores) plus a few short aliases (``--tp --pp --vpp --ep --etp --cp --dispatcher``)::

    args = parse_args(mode="finetune")          # sys.argv[1:]; --config FILE.yaml supplies defaults
    args = validate_args(args, world_size)      # one ArgumentError per mistake; sets the derived fields
    tcfg = args.model_config.to_transformer_config(**args_to_overrides(args))

With no flags at all the defaults are a complete tiny CPU run (tiny preset, the shipped tiny tokenizer and data,
300 iterations, checkpoints under ``runs/<mode>_tiny``).

``--config FILE.yaml`` is a mapping whose keys are flags in any spelling (``tensor-model-parallel-size``,
``tensor_model_parallel_size`` or ``tp``); its values become defaults, so flags given on the command line win.

:func:`validate_args` checks the flags in sections (precision, model, parallel layout, hybridep node size,
batch, DSA, MoE, optimizer and schedule, recompute, data, checkpoints and logging), each a small ``_check_*``
function returning its share of one frozen :class:`DerivedArgs` record, and writes that record's fields onto the
namespace: ``world_size``, ``data_parallel_size``, ``expert_data_parallel_size``, ``num_microbatches``,
``params_dtype`` (a torch dtype), ``model_config`` (the :class:`~megatron_glm5.config.GLM5Config`),
``data_blend`` / ``valid_data_blend`` ((paths, weights or None)), ``split_fractions``, and the resolved
``sequence_parallel``, ``bf16``, ``mtp``, ``expert_tensor_parallel_size``, ``virtual_pipeline_model_parallel_size``,
``moe_router_load_balancing_type``, ``lr_warmup_iters``, ``lr_decay_iters``, ``lr_wsd_decay_iters``,
``recompute_method`` / ``recompute_num_layers``, ``global_batch_size``, ``node_size``, ``tensorboard_dir`` and
``peak_tflops``.  A default that follows from the flags alone is written once, in :func:`_flag_defaults`, which
:func:`args_to_overrides` reads too.

This module must stay cheap to import: it does not import megatron.core (``--help`` is instant) and imports torch
only inside :func:`validate_args` / :func:`args_to_overrides`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import functools
import logging
import math
import os
import shlex
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from megatron_glm5.config import DSA_STAGES, PRESETS  # stdlib-only module: cheap to import
from megatron_glm5.sample_limits import MAX_SAMPLE_BYTES  # stdlib-only module
from megatron_glm5.errors import FlagError, UserError
from megatron_glm5.training import memory_options  # stdlib-only module: the memory options' flags and checks
from megatron_glm5.training import muon_flags  # stdlib-only module: the Muon flags and checks
from megatron_glm5.training import manual_gc  # stdlib-only module: --manual-gc
from megatron_glm5.lora import flags as lora_flags  # stdlib-only module: the LoRA flags and checks
from megatron_glm5.fp8 import flags as fp8_flags  # stdlib-only module: --base-precision and its checks
from megatron_glm5.model import cross_entropy_flags  # stdlib-only module: --cross-entropy-fusion
from megatron_glm5.model import fusion_flags  # stdlib-only module: --fusions

__all__ = [
    "ArgumentError",
    "MODES",
    "ATTN_BACKENDS",
    "DISPATCHERS",
    "RECOMPUTE_MODULES",
    "DEFAULT_PEAK_TFLOPS",
    "asset_path",
    "build_parser",
    "parse_args",
    "load_yaml_config",
    "validate_args",
    "args_to_overrides",
    "parse_data_blend",
    "is_user_error",
    "main_guard",
]

logger = logging.getLogger("megatron_glm5.arguments")

MODES = ("finetune", "pretrain")
from megatron_glm5.ops.registry import ATTN_CHOICES as ATTN_BACKENDS  # noqa: E402  "auto" + the registry's names
DISPATCHERS = ("alltoall", "allgather", "hybridep")
LOAD_BALANCING_TYPES = ("none", "aux_loss", "seq_aux_loss", "global_aux_loss")
LR_DECAY_STYLES = ("cosine", "linear", "constant", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
EXIT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")
# megatron-core 0.19.2 TransformerConfig: the allowed --recompute-modules (selective recompute).
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
# Dense bf16 peak of an H100 / H200 SXM (TFLOP/s per GPU), the MFU denominator by default on a GPU.
DEFAULT_PEAK_TFLOPS = 989.0
DEFAULT_LR_WARMUP_ITERS = 30

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))


def asset_path(*parts: str) -> str:
    """Absolute path of a file shipped under ``megatron_glm5/assets`` (it need not exist yet)."""
    return os.path.join(_PKG_DIR, "assets", *parts)


_DEFAULT_DATA = {
    "finetune": ([asset_path("data", "chat_train.jsonl")], [asset_path("data", "chat_valid.jsonl")]),
    "pretrain": ([asset_path("data", "pretrain_a.jsonl")], None),
}


class ArgumentError(FlagError):
    """A bad flag or flag combination.  ``flag`` names the (first) offending flag when there is one."""


# --------------------------------------------------------------------------------------------------------------
# Value types (also applied to values from --config YAML files)
# --------------------------------------------------------------------------------------------------------------


def _number(value: Any, kind: type) -> Any:
    if isinstance(value, bool):
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}")
    if kind is int:
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        try:
            return int(str(value).strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
    try:
        return float(value)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None


def _typed(kind: type, minimum: Optional[float] = None, strict: bool = False, name: str = "") -> Callable[[Any], Any]:
    def convert(value: Any) -> Any:
        v = _number(value, kind)
        if kind is float and not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {value!r}")
        if minimum is not None and (v <= minimum if strict else v < minimum):
            what = {(0, True): "positive", (0, False): "non-negative"}.get((minimum, strict), f">= {minimum}")
            raise argparse.ArgumentTypeError(f"must be a {what} {'integer' if kind is int else 'number'}, got {value!r}")
        return v

    convert.__name__ = name or kind.__name__
    return convert


_pos_int = _typed(int, 0, strict=True, name="positive integer")
_nonneg_int = _typed(int, 0, name="non-negative integer")
_float = _typed(float, name="number")
_nonneg_float = _typed(float, 0, name="non-negative number")
_pos_float = _typed(float, 0, strict=True, name="positive number")


def _fraction(value: Any) -> float:
    v = _number(value, float)
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value!r}")
    return v


def _text(value: Any) -> str:
    if isinstance(value, (bool, list, dict)) or value is None:
        raise argparse.ArgumentTypeError(f"expected a string, got {value!r}")
    return str(value)


# --------------------------------------------------------------------------------------------------------------
# Parser
# --------------------------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse that raises :class:`ArgumentError` (one line) instead of printing usage and exiting."""

    def error(self, message: str):  # noqa: D401 - argparse API
        raise ArgumentError(f"{message} (see {self.prog} --help)")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows ``(default: X)`` unless the default is None/False or the help already describes it."""

    def __init__(self, prog: str):
        super().__init__(prog, max_help_position=40, width=120)

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if "%(default)" in help_text or "default" in help_text:
            return help_text
        if action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return help_text
        if isinstance(action.default, list):
            return help_text + " (default: " + " ".join(map(str, action.default)) + ")"
        return help_text + " (default: %(default)s)"


_HELP_EXAMPLE = {
    "finetune": "--config examples/recipes/glm5.3_sft_32x8.yaml",
    "pretrain": "--preset glm5.3 --data-path 0.7 data/corpus_a 0.3 data/corpus_b --tokenizer /models/GLM-5.3 "
                "--ep 8 --bf16",
}


def build_parser(mode: str = "finetune") -> argparse.ArgumentParser:
    """The argparse parser of ``<mode>_glm5.py`` (``mode`` is "finetune" or "pretrain")."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    finetune = mode == "finetune"
    prog = f"{mode}_glm5.py"
    p = _Parser(
        prog=prog,
        description=(
            f"{'Fine-tune (SFT)' if finetune else 'Pretrain'} a GLM-5 model on megatron-core.  With no flags: a tiny "
            f"CPU run on the shipped data.  Launch multi-GPU runs with torchrun, e.g.\n"
            f"  torchrun --nproc-per-node=8 {prog} {_HELP_EXAMPLE[mode]}"
        ),
        formatter_class=_HelpFormatter,
        allow_abbrev=False,
    )

    g = p.add_argument_group("model")
    g.add_argument("--preset", default="tiny", metavar="NAME",
                   help=f"model preset: {', '.join(PRESETS)} (default: tiny)")
    g.add_argument("--hf-config", default=None, metavar="PATH",
                   help="a GlmMoeDsa config.json or a directory holding one; overrides --preset")
    g.add_argument("--mtp", action=argparse.BooleanOptionalAction, default=None,
                   help="train the multi-token-prediction layer (default: on when the model config has one)")
    g.add_argument("--mtp-loss-scaling-factor", type=_nonneg_float, default=0.1, metavar="X",
                   help="weight of the MTP loss")
    g.add_argument("--mtp-steps", type=_pos_int, default=1, metavar="N",
                   help="apply the (single) MTP module N times, predicting N tokens ahead with shared weights "
                        "(the GLM-5 report trains with 3); default 1")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", "--tp", type=_pos_int, default=1, metavar="N",
                   help="tensor-parallel size")
    g.add_argument("--pipeline-model-parallel-size", "--pp", type=_pos_int, default=1, metavar="N",
                   help="pipeline-parallel size")
    g.add_argument("--virtual-pipeline-model-parallel-size", "--vpp", type=_pos_int, default=None, metavar="N",
                   help="virtual pipeline stages per pipeline rank (interleaved schedule; needs --pp > 1)")
    g.add_argument("--expert-model-parallel-size", "--ep", type=_pos_int, default=1, metavar="N",
                   help="expert-parallel size")
    g.add_argument("--expert-tensor-parallel-size", "--etp", type=_pos_int, default=None, metavar="N",
                   help="tensor-parallel size inside each expert (default: 1)")
    g.add_argument("--context-parallel-size", "--cp", type=_pos_int, default=1, metavar="N",
                   help="context-parallel size (splits the sequence)")
    g.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                   help="sequence parallelism (default: on when --tp > 1)")
    g.add_argument("--decoder-first-pipeline-num-layers", type=_pos_int, default=None, metavar="N",
                   help="layers on the first pipeline stage (uneven split, e.g. 78 layers at --pp 4)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=_pos_int, default=None, metavar="N",
                   help="layers on the last pipeline stage (uneven split)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard the optimizer state over data-parallel ranks")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="overlap the gradient reduce-scatter/all-reduce with the backward pass")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="overlap the parameter all-gather with the forward pass (needs --use-distributed-optimizer)")
    g.add_argument("--moe-token-dispatcher-type", "--dispatcher", choices=DISPATCHERS, default="alltoall",
                   help="MoE token dispatcher")
    g.add_argument("--node-size", type=_pos_int, default=None, metavar="N",
                   help="ranks per node, for the hybridep dispatcher (default: $LOCAL_WORLD_SIZE, else "
                        "min(world size, 8))")
    g.add_argument("--moe-permute-fusion", action=argparse.BooleanOptionalAction, default=None,
                   help="MoE token permute/unpermute with our fused Triton kernels (deterministic) instead of "
                        "megatron-core's unfused ops (default: on when CUDA and triton are available)")

    g = p.add_argument_group("attention (DSA)")
    g.add_argument("--attn", choices=ATTN_BACKENDS, default="auto",
                   help="indexer / sparse-attention kernels; auto picks the best available (torch on CPU)")
    g.add_argument("--dsa-stage", choices=DSA_STAGES, default="sparse",
                   help="dense-warmup: dense attention, only the indexer trains; sparse: top-k attention")
    g.add_argument("--dsa-indexer-loss-coeff", type=_float, default=1e-3, metavar="X",
                   help="weight of the indexer KL loss (Megatron-Bridge's value)")
    g.add_argument("--freeze-indexer", action="store_true", help="freeze the lightning-indexer weights")

    g = p.add_argument_group("MoE")
    g.add_argument("--moe-aux-loss-coeff", type=_float, default=0.0, metavar="X",
                   help="load-balancing loss weight (GLM-5 balances with the router bias instead)")
    g.add_argument("--moe-router-load-balancing-type", choices=LOAD_BALANCING_TYPES, default=None,
                   help="default: seq_aux_loss when --moe-aux-loss-coeff > 0, else none")
    g.add_argument("--moe-router-bias-update-rate", type=_float, default=1e-3, metavar="X",
                   help="step of the aux-loss-free expert-bias update")
    g.add_argument("--moe-router-dtype", choices=("fp32", "fp64"), default=None,
                   help="router compute dtype (default: the model config's, fp32)")

    g = p.add_argument_group("batch and sequence")
    g.add_argument("--micro-batch-size", type=_pos_int, default=4, metavar="N",
                   help="sequences per micro-batch per data-parallel rank")
    g.add_argument("--global-batch-size", type=_pos_int, default=None, metavar="N",
                   help="sequences per optimizer step (default: micro-batch size x data-parallel size)")
    g.add_argument("--seq-length", type=_pos_int, default=128, metavar="N", help="tokens per sequence")
    if finetune:
        g.add_argument("--packing", action=argparse.BooleanOptionalAction, default=True,
                       help="pack several conversations into each --seq-length row")

    g = p.add_argument_group("optimizer and schedule")
    g.add_argument("--optimizer", choices=("adam", "muon"), default="adam",
                   help="AdamW, or Muon for the matrices (AdamW for the rest; docs/muon.md)")
    g.add_argument("--lr", type=_nonneg_float, default=3e-3, metavar="X", help="peak learning rate")
    g.add_argument("--min-lr", type=_nonneg_float, default=3e-4, metavar="X", help="final learning rate")
    g.add_argument("--lr-warmup-iters", type=_nonneg_int, default=None, metavar="N",
                   help=f"linear warm-up iterations (default: 10%% of --train-iters, at most "
                        f"{DEFAULT_LR_WARMUP_ITERS})")
    g.add_argument("--lr-warmup-fraction", type=_fraction, default=None, metavar="F",
                   help="warm-up as a fraction of --lr-decay-iters (instead of --lr-warmup-iters)")
    g.add_argument("--lr-decay-style", choices=LR_DECAY_STYLES, default="cosine", help="decay after warm-up")
    g.add_argument("--lr-decay-iters", type=_pos_int, default=None, metavar="N",
                   help="iterations over which the learning rate decays (default: --train-iters)")
    g.add_argument("--lr-wsd-decay-style", choices=WSD_DECAY_STYLES, default="exponential",
                   help="decay shape of the WSD schedule's final phase")
    g.add_argument("--lr-wsd-decay-iters", type=_pos_int, default=None, metavar="N",
                   help="length of the WSD schedule's final decay (default: 10%% of --lr-decay-iters)")
    g.add_argument("--weight-decay", type=_nonneg_float, default=0.1, metavar="X", help="decoupled weight decay")
    g.add_argument("--clip-grad", type=_nonneg_float, default=1.0, metavar="X",
                   help="gradient-norm clipping (0 disables)")
    g.add_argument("--adam-beta1", type=_float, default=0.9, metavar="X", help="Adam beta1")
    g.add_argument("--adam-beta2", type=_float, default=0.95, metavar="X", help="Adam beta2")
    g.add_argument("--adam-eps", type=_pos_float, default=1e-8, metavar="X", help="Adam epsilon")
    g.add_argument("--train-iters", type=_pos_int, default=300, metavar="N", help="optimizer steps")

    g = p.add_argument_group("numerical faults (docs/bad_input.md)")
    g.add_argument("--max-skipped-steps", type=_pos_int, default=10, metavar="N",
                   help="a step whose loss or gradient is NaN/Inf on any rank is skipped (no update, no LR step, its "
                        "data consumed); stop with an error after N such steps in a row")
    g.add_argument("--loss-spike-threshold", type=_nonneg_float, default=6.0, metavar="K",
                   help="log a loss spike when the LM loss exceeds the mean of the last --loss-spike-window steps "
                        "by K standard deviations (0 turns the detector off)")
    g.add_argument("--loss-spike-window", type=_pos_int, default=100, metavar="N",
                   help="steps of LM loss the spike detector compares with")

    g = p.add_argument_group("precision")
    g.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 parameters and compute with fp32 master weights (default: on with a CUDA GPU, "
                        "fp32 on CPU)")
    g.add_argument("--fp16", action="store_true", help="not supported: GLM-5 trains in bf16")

    g = p.add_argument_group("activation recompute")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None,
                   help="full: whole layers; selective: the --recompute-modules")
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None,
                   help="which layers full recompute covers (default with full: uniform)")
    g.add_argument("--recompute-num-layers", type=_pos_int, default=None, metavar="N",
                   help="layers per recompute unit (uniform) or per stage (block) (default with full: 1)")
    g.add_argument("--recompute-modules", nargs="*", default=None, metavar="MODULE",
                   help=f"selective recompute: {', '.join(RECOMPUTE_MODULES)} (default: core_attn); the router "
                        "is never recomputed")

    g = p.add_argument_group("data")
    train_default, valid_default = _DEFAULT_DATA[mode]
    g.add_argument("--data-path", nargs="+", default=train_default, metavar="PATH",
                   help=("training data: jsonl chat files, optionally weighted ('0.7 a.jsonl 0.3 b.jsonl')"
                         if finetune else
                         "training data: Megatron blend 'w1 prefix1 w2 prefix2 ...' or plain prefixes / jsonl files")
                        + " (default: the shipped tiny data)")
    g.add_argument("--valid-data-path", nargs="+", default=valid_default, metavar="PATH",
                   help="validation data, same format as --data-path"
                        + (" (default: the shipped tiny validation data)" if finetune
                           else " (default: the --split share of --data-path)"))
    g.add_argument("--split", type=_text, default="98,1,1", metavar="T,V,E",
                   help="train,valid,test proportions when there is no --valid-data-path")
    g.add_argument("--tokenizer", type=_text, default="tiny", metavar="PATH",
                   help="a Hugging Face tokenizer directory, a sentencepiece .model file, or 'tiny' (shipped)")
    g.add_argument("--data-cache-path", default=None, metavar="DIR", help="where dataset indices are cached")
    g.add_argument("--skip-bad-samples", action="store_true",
                   help="skip (and count) malformed samples instead of stopping")
    g.add_argument("--overlong", choices=("truncate", "drop"), default="truncate",
                   help="what to do with samples longer than --seq-length")
    g.add_argument("--max-sample-bytes", type=_pos_int, default=MAX_SAMPLE_BYTES, metavar="N",
                   help="a jsonl line longer than N bytes is refused before it is decoded (an error naming "
                        "file:line; skipped and counted with --skip-bad-samples) (default: 8388608, 8 MiB)")
    g.add_argument("--num-workers", type=_nonneg_int, default=2, metavar="N", help="data-loader workers")

    g = p.add_argument_group("checkpoints")
    g.add_argument("--save", default=None, metavar="DIR",
                   help=f"this run's directory: checkpoints, TensorBoard events, metrics (default: a new "
                        f"runs/{mode}_<preset>/<date-time> per run; with --load of a run directory, that one). "
                        "A directory holds one run: a new run there is refused unless --overwrite")
    g.add_argument("--no-save", action="store_true", help="do not write checkpoints")
    g.add_argument("--load", default=None, metavar="DIR", help="checkpoint to resume from (or start from, "
                   "with --finetune)")
    g.add_argument("--resume", action="store_true",
                   help="continue the run in --save (without --save: the newest run under "
                        f"runs/{mode}_<preset>/) from its latest checkpoint")
    g.add_argument("--overwrite", action="store_true",
                   help="start a new run in a --save directory that holds another run: that run's checkpoints, "
                        "events and metrics are deleted first")
    g.add_argument("--save-interval", type=_pos_int, default=100, metavar="N", help="iterations between saves")
    g.add_argument("--finetune", action="store_true",
                   help="load only the weights from --load (fresh optimizer, scheduler and iteration count)")
    g.add_argument("--no-load-optim", action="store_true", help="do not load the optimizer state")
    g.add_argument("--no-load-rng", action="store_true", help="do not load the RNG state")
    g.add_argument("--override-opt-param-scheduler", action="store_true",
                   help="on resume, take the LR schedule (--lr, --min-lr, warm-up, decay, weight decay) from the "
                   "flags instead of the checkpoint; the step count is still restored")
    g.add_argument("--keep-last", type=_pos_int, default=None, metavar="N",
                   help="keep only the newest N checkpoints (default: keep all); the newest one that verifies "
                   "is never deleted")
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoints in a background thread while training continues (docs/fault_tolerance.md)")
    g.add_argument("--ckpt-checksum", choices=("sha256", "crc32", "none"), default="sha256",
                   help="checksum recorded per checkpoint file in its manifest and verified on load "
                   "('none': sizes only)")
    g.add_argument("--exit-interval", type=_pos_int, default=None, metavar="N",
                   help="save and exit when the iteration is a multiple of N")
    g.add_argument("--exit-duration-in-mins", type=_pos_float, default=None, metavar="MIN",
                   help="save and exit after this many minutes")
    g.add_argument("--exit-signal", choices=EXIT_SIGNALS, default="SIGTERM",
                   help="signal on which to save a checkpoint and exit")

    g = p.add_argument_group("logging and evaluation")
    g.add_argument("--log-interval", type=_pos_int, default=10, metavar="N", help="iterations between log lines")
    g.add_argument("--tensorboard-dir", default=None, metavar="DIR",
                   help="TensorBoard event directory (default: <save>/tensorboard when saving)")
    g.add_argument("--eval-interval", type=_pos_int, default=50, metavar="N",
                   help="iterations between evaluations")
    g.add_argument("--eval-iters", type=_nonneg_int, default=10, metavar="N",
                   help="micro-batch rounds per evaluation (0 disables evaluation)")
    g.add_argument("--eval-only", action="store_true",
                   help="evaluate --load on the validation data (loss and perplexity) and exit: no training, "
                        "nothing written")
    g.add_argument("--verbose", action="store_true",
                   help="show every library warning and log line (by default warnings that carry nothing for "
                        "the user are filtered once, at their source)")
    g.add_argument("--peak-tflops", type=_pos_float, default=None, metavar="X",
                   help=f"per-GPU peak TFLOP/s for MFU (default: {DEFAULT_PEAK_TFLOPS:g} on a GPU, the dense bf16 "
                        "peak of an H100/H200; no MFU on CPU)")

    g = p.add_argument_group("misc")
    g.add_argument("--seed", type=_nonneg_int, default=1234, metavar="N", help="random seed")
    g.add_argument("--skip-memory-check", action="store_true",
                   help="start even when the layout planner estimates that this rank's share of the model does not "
                        "fit its GPU (or, on CPU, the machine's available memory)")
    g.add_argument("--distributed-timeout-minutes", type=_pos_float, default=10.0, metavar="MIN",
                   help="timeout of collectives; a rank that makes no progress for this long names the ranks it "
                        "waits for and the job stops with exit status 3")
    g.add_argument("--config", default=None, metavar="FILE.yaml",
                   help="YAML mapping of flag: value used as defaults (command-line flags override it)")
    memory_options.add_flags(p)
    muon_flags.add_flags(p)
    manual_gc.add_flags(p)
    lora_flags.add_flags(p)
    fp8_flags.add_flags(p)
    cross_entropy_flags.add_flags(p)
    fusion_flags.add_flags(p)
    return p


# --------------------------------------------------------------------------------------------------------------
# --config YAML
# --------------------------------------------------------------------------------------------------------------


def _find_action(parser: argparse.ArgumentParser, key: str) -> Tuple[Optional[argparse.Action], str]:
    """The parser action for a YAML key in any spelling, and the option string it matched."""
    name = key.strip()
    while name.startswith("-"):
        name = name[1:]
    table = parser._option_string_actions  # noqa: SLF001 - the public API has no lookup
    for option in (f"--{name}", f"--{name.replace('_', '-')}"):
        action = table.get(option)
        if action is not None and not isinstance(action, argparse._HelpAction):  # noqa: SLF001
            return action, option
    return None, ""


def _yaml_key_lines(text: str) -> List[Tuple[Any, int]]:
    """(key, 1-based line) of each top-level key in file order, a repeated key once per occurrence (best effort)."""
    import yaml

    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return []
    if not isinstance(node, yaml.MappingNode):
        return []
    return [(k.value, k.start_mark.line + 1) for k, _ in node.value if isinstance(k, yaml.ScalarNode)]


def _convert_yaml_value(action: argparse.Action, option: str, value: Any) -> Any:
    """A YAML value converted as the command line would convert it; raises ArgumentTypeError."""
    if isinstance(action, argparse.BooleanOptionalAction):
        if value is None:
            return None
        if not isinstance(value, bool):
            raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")
        return (not value) if option.startswith("--no-") else value
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):  # noqa: SLF001
        if not isinstance(value, bool):
            raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")
        return value if isinstance(action, argparse._StoreTrueAction) else not value  # noqa: SLF001
    convert = action.type or _text
    if action.nargs in ("+", "*"):
        if value is None:
            return None
        if isinstance(value, str):
            items = shlex.split(value)
        elif isinstance(value, (list, tuple)):
            items = list(value)
        else:
            items = [value]
        if action.nargs == "+" and not items:
            raise argparse.ArgumentTypeError("expected at least one value")
        out = [convert(v) for v in items]
        if action.choices is not None:
            for v in out:
                if v not in action.choices:
                    raise argparse.ArgumentTypeError(f"invalid choice {v!r} (choose from {', '.join(action.choices)})")
        return out
    if value is None:
        return None
    if isinstance(value, (list, tuple, dict)):
        raise argparse.ArgumentTypeError(f"expected a single value, got {value!r}")
    out = convert(value)
    if action.choices is not None and out not in action.choices:
        raise argparse.ArgumentTypeError(
            f"invalid choice {out!r} (choose from {', '.join(map(str, action.choices))})"
        )
    return out


def load_yaml_config(path: str, parser: argparse.ArgumentParser) -> Dict[str, Any]:
    """Read a ``--config`` YAML file into ``{dest: value}`` for ``parser.set_defaults``.

    Keys are flags in any spelling (``tensor-model-parallel-size``, ``tensor_model_parallel_size``, ``tp``,
    ``no-packing``); values are converted and checked like command-line values; lists are allowed for list flags
    (a string is split like a shell would).  Unknown keys, duplicates and bad values raise :class:`ArgumentError`
    naming the file, the line and the key.
    """
    import yaml

    try:
        with open(path, "r", encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ArgumentError(f"--config {path}: cannot read it ({e.strerror or e})", flag="--config") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ArgumentError(f"--config {path}{where}: not valid YAML ({problem})", flag="--config") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ArgumentError(
            f"--config {path}: expected a mapping of flag: value, got a {type(data).__name__}", flag="--config"
        )
    key_lines = _yaml_key_lines(text)
    lines: Dict[Any, int] = {}
    for key, line in key_lines:  # YAML keeps the last of a repeated key: refuse it instead of guessing
        if key in lines:
            raise ArgumentError(f"--config {path}:{line}: key {key!r} is given twice (lines {lines[key]} and "
                                f"{line}); keep one", flag="--config")
        lines[key] = line
    known = sorted({o.lstrip("-") for o in parser._option_string_actions if o.startswith("--")} - {"help"})  # noqa: SLF001
    out: Dict[str, Any] = {}
    source: Dict[str, str] = {}
    for key, value in data.items():
        where = f"{path}:{lines[key]}" if key in lines else path
        if not isinstance(key, str):
            raise ArgumentError(f"{where}: key {key!r} is not a flag name", flag="--config")
        action, option = _find_action(parser, key)
        if action is None:
            close = difflib.get_close_matches(key.lstrip("-").replace("_", "-"), known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ArgumentError(f"{where}: unknown key {key!r} (not a flag of {parser.prog}){hint}", flag="--config")
        if action.dest == "config":
            raise ArgumentError(f"{where}: 'config' cannot be nested in a config file", flag="--config")
        if action.dest in source:
            first = source[action.dest]
            at = f" (line {lines[first]})" if first in lines else ""
            raise ArgumentError(
                f"{where}: key {key!r} sets the same flag as {first!r}{at}; keep one", flag="--config"
            )
        try:
            out[action.dest] = _convert_yaml_value(action, option, value)
        except (argparse.ArgumentTypeError, TypeError, ValueError) as e:
            raise ArgumentError(f"{where}: {key}: {e}", flag=action.option_strings[0]) from None
        source[action.dest] = key
    return out


def _config_path(argv: Sequence[str]) -> Optional[str]:
    path = None
    for i, a in enumerate(argv):
        if a == "--":
            break
        if a == "--config":
            if i + 1 >= len(argv):
                raise ArgumentError("argument --config: expected one argument", flag="--config")
            path = argv[i + 1]
        elif a.startswith("--config="):
            path = a.split("=", 1)[1]
    return path


# --------------------------------------------------------------------------------------------------------------
# parse_args
# --------------------------------------------------------------------------------------------------------------


def _model_slug(args: argparse.Namespace) -> str:
    if args.hf_config:
        path = os.path.normpath(args.hf_config)
        if path.endswith(".json"):
            path = os.path.dirname(path) or "."
        return os.path.basename(os.path.abspath(path)) or "hf"
    return str(args.preset)


def parse_args(argv: Optional[Sequence[str]] = None, mode: str = "finetune") -> argparse.Namespace:
    """Parse ``argv`` (default ``sys.argv[1:]``) for ``mode`` ("finetune" or "pretrain").

    ``--config FILE.yaml`` values become defaults; explicit flags override them.  Raises :class:`ArgumentError`
    for an unknown flag or a bad value (``--help`` still prints and exits).  Only cheap, environment-based
    defaults are filled here (``save``, ``node_size``); call :func:`validate_args` for the rest.
    """
    parser = build_parser(mode)
    argv = list(sys.argv[1:] if argv is None else argv)
    config = _config_path(argv)
    from_config = load_yaml_config(config, parser) if config else {}
    parser.set_defaults(**from_config)
    args = parser.parse_args(argv)
    # the dests given on the command line or in --config (where a checkpoint's value may win over a default only)
    given = build_parser(mode)
    for action in given._actions:  # noqa: SLF001 - a parser that records only what the command line sets
        action.default = argparse.SUPPRESS
    args.explicit_flags = tuple(sorted(set(vars(given.parse_known_args(argv)[0])) | set(from_config)))
    args.mode = mode
    if mode == "pretrain":
        args.packing = True  # pretraining always concatenates documents into --seq-length rows
    args.save_is_default = False
    if args.no_save:
        args.save = None
    elif not args.save:
        from megatron_glm5.training.run_dir import default_run_root, read_run, run_dir_of_load

        continued = run_dir_of_load(args.load) if args.load and not args.finetune and not args.resume else None
        if continued is not None and read_run(continued) is not None:
            args.save = continued  # --load of a run directory continues that run in place
        else:  # a fresh directory per run under this root (run_dir.claim picks the name)
            args.save = default_run_root(mode, _model_slug(args))
            args.save_is_default = True
    if args.node_size is None:
        env = os.environ.get("LOCAL_WORLD_SIZE", "")
        if env.strip().isdigit() and int(env) > 0:
            args.node_size = int(env)
    return args


# --------------------------------------------------------------------------------------------------------------
# validate_args
# --------------------------------------------------------------------------------------------------------------


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _resolve_world_size(world_size: Optional[int]) -> int:
    if world_size is None:
        env = os.environ.get("WORLD_SIZE", "1")
        try:
            world_size = int(env)
        except ValueError:
            raise ArgumentError(f"$WORLD_SIZE is not an integer: {env!r}") from None
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ArgumentError(f"world size must be a positive integer, got {world_size!r}")
    return world_size


def _load_model_config(args: argparse.Namespace):
    from megatron_glm5.config import ConfigError, GLM5Config

    if args.load and not args.hf_config and "preset" not in getattr(args, "explicit_flags", ("preset",)):
        cfg = _checkpoint_model_config(args.load)  # --load DIR alone: the model the checkpoint is of
        if cfg is not None:
            return cfg
    if args.hf_config:
        try:
            return GLM5Config.from_hf(args.hf_config)
        except FileNotFoundError as e:
            raise ArgumentError(f"--hf-config {args.hf_config}: {e}", flag="--hf-config") from None
        except (ConfigError, OSError) as e:
            raise ArgumentError(f"--hf-config {args.hf_config}: {e}", flag="--hf-config") from None
    try:
        return GLM5Config.from_preset(args.preset)
    except ConfigError as e:
        raise ArgumentError(f"--preset: {e}", flag="--preset") from None


def _checkpoint_model_config(load: str):
    """The GLM5Config recorded in a checkpoint (its "glm5" record; a converted checkpoint's config.json when the
    record cannot be read): one checkpoint directory, or a --save root at its latest pointer, else the newest
    checkpoint whose record reads. None when none reads (not a checkpoint, or damaged: loading it says what is
    wrong, naming the files)."""
    from megatron_glm5.checkpoint.format import (DCP_METADATA, CheckpointFormatError, complete_dirs, iteration_dir,
                                                 read_latest, read_record)
    from megatron_glm5.config import ConfigError, GLM5Config

    if not os.path.isdir(load):
        return None
    candidates = [load]
    if not os.path.isfile(os.path.join(load, DCP_METADATA)):
        try:
            pointer = read_latest(load)
        except CheckpointFormatError:
            pointer = None
        candidates = [iteration_dir(load, pointer)] if pointer is not None else []
        candidates += [p for _, p in complete_dirs(load) if p not in candidates]
    for path in candidates:
        try:
            source = read_record(path).model_config
        except CheckpointFormatError:
            source = os.path.join(path, "config.json")
            if not os.path.isfile(source):
                continue
        try:
            cfg = GLM5Config.from_hf(source)
        except (ConfigError, OSError) as e:
            raise ArgumentError(f"--load {load}: the checkpoint's model config: {e}", flag="--load") from None
        logger.info("model: the one checkpoint %s holds (--preset/--hf-config not given)", load)
        return cfg
    return None


def parse_data_blend(items: Optional[Sequence[str]], flag: str = "--data-path") -> Optional[Tuple[List[str], Optional[List[float]]]]:
    """``["0.7", "a", "0.3", "b"]`` -> ``(["a", "b"], [0.7, 0.3])``; ``["a", "b"]`` -> ``(["a", "b"], None)``
    (megatron-core's blend format).  Raises :class:`ArgumentError` naming ``flag`` on a malformed list."""
    if items is None:
        return None
    items = [str(x) for x in items]
    if not items:
        raise ArgumentError(f"{flag}: expected at least one path", flag=flag)

    def is_weight(s: str) -> bool:
        try:
            float(s)
        except ValueError:
            return False
        return True

    if not any(is_weight(x) for x in items):
        return items, None
    if len(items) % 2 or not all(is_weight(w) and not is_weight(p) for w, p in zip(items[::2], items[1::2])):
        raise ArgumentError(
            f"{flag}: a weighted blend alternates weights and paths ('0.7 a 0.3 b'), got {' '.join(items)!r}",
            flag=flag,
        )
    weights = [float(w) for w in items[::2]]
    if any(w < 0 or not math.isfinite(w) for w in weights) or sum(weights) <= 0:
        raise ArgumentError(f"{flag}: blend weights must be non-negative with a positive sum, got {weights}",
                            flag=flag)
    return items[1::2], weights


def _parse_split(split: str) -> Tuple[float, float, float]:
    parts = [s.strip() for s in str(split).replace("/", ",").split(",") if s.strip()]
    try:
        values = [float(s) for s in parts]
    except ValueError:
        values = []
    if not 1 <= len(values) <= 3 or any(v < 0 or not math.isfinite(v) for v in values) or sum(values) <= 0:
        raise ArgumentError(
            f"--split {split!r}: expected up to three non-negative proportions 'train,valid,test' such as 98,1,1",
            flag="--split",
        )
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return tuple(v / total for v in values)  # type: ignore[return-value]


def _suggest_uneven_split(num_layers: int, pp: int) -> Optional[Tuple[int, int]]:
    """first = last = f with the middle stages even, f as close to num_layers / pp as possible, preferring the
    lighter side (the first stage also holds the embedding, the last one the output head and MTP)."""
    if pp < 3:
        return None
    target = num_layers / pp
    options = [f for f in range(1, num_layers // 2 + 1)
               if num_layers - 2 * f > 0 and (num_layers - 2 * f) % (pp - 2) == 0]
    return (min(options, key=lambda f: (f > target, abs(f - target))),) * 2 if options else None  # type: ignore[return-value]


def _check_pipeline_layout(args: argparse.Namespace, num_layers: int, pp: int, vpp: Optional[int]) -> bool:
    """Check the layer split over pipeline stages; returns True when it is uneven."""
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    if first is None and last is None:
        if num_layers % pp:
            hint = ""
            s = _suggest_uneven_split(num_layers, pp)
            if s:
                hint = (f"; split it unevenly, e.g. --decoder-first-pipeline-num-layers {s[0]} "
                        f"--decoder-last-pipeline-num-layers {s[1]}")
            raise ArgumentError(f"--pp {pp} does not divide the model's {num_layers} layers{hint}", flag="--pp")
        if vpp is not None and (num_layers // pp) % vpp:
            raise ArgumentError(
                f"--vpp {vpp} does not divide the {num_layers // pp} layers of each pipeline stage", flag="--vpp"
            )
        return False
    flag = "--decoder-first-pipeline-num-layers" if first is not None else "--decoder-last-pipeline-num-layers"
    if pp == 1:
        raise ArgumentError(f"{flag} needs --pp > 1", flag=flag)
    middle_stages = pp - (first is not None) - (last is not None)
    middle_layers = num_layers - (first or 0) - (last or 0)
    given = " + ".join(f"{f} {v}" for f, v in (("--decoder-first-pipeline-num-layers", first),
                                               ("--decoder-last-pipeline-num-layers", last)) if v is not None)
    if middle_layers < 0 or (middle_stages == 0) != (middle_layers == 0) or (
        middle_stages and middle_layers % middle_stages
    ):
        raise ArgumentError(
            f"{given} leave{'' if ' + ' in given else 's'} {middle_layers} of the model's {num_layers} layers for {middle_stages} middle "
            f"pipeline stage(s) at --pp {pp}; the middle stages need an equal, non-zero share "
            f"(the stages must sum to {num_layers})",
            flag=flag,
        )
    if vpp is not None:
        for f, v in (("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last),
                     ("layers per middle stage", middle_layers // middle_stages if middle_stages else None)):
            if v is not None and v % vpp:
                raise ArgumentError(f"--vpp {vpp} does not divide {f} {v}", flag="--vpp")
    return True


# The derived values, and the sections that compute them ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DerivedArgs:
    """Every value :func:`validate_args` derives from the flags, computed once by the section checks below.

    :func:`validate_args` writes each field onto the namespace under its own name (``args.num_microbatches``...),
    where the trainer and :func:`args_to_overrides` read it.  ``world_size`` ... ``split_fractions`` are new
    attributes; the others replace a flag's unresolved value (None, "auto") with the resolved one.
    """

    world_size: int
    bf16: bool
    params_dtype: Any  # torch.bfloat16 or torch.float32
    model_config: Any  # megatron_glm5.config.GLM5Config
    mtp: bool
    fresh_mtp: bool  # --mtp on a checkpoint without MTP weights: that layer keeps its fresh initialisation
    expert_tensor_parallel_size: int
    virtual_pipeline_model_parallel_size: Optional[int]
    data_parallel_size: int
    expert_data_parallel_size: int
    sequence_parallel: bool
    node_size: int
    global_batch_size: int
    num_microbatches: int
    moe_router_load_balancing_type: str
    lr_decay_iters: int
    lr_warmup_iters: int
    lr_wsd_decay_iters: Optional[int]
    recompute_method: Optional[str]
    recompute_num_layers: Optional[int]
    data_blend: Optional[Tuple[List[str], Optional[List[float]]]]
    valid_data_blend: Optional[Tuple[List[str], Optional[List[float]]]]
    split_fractions: Tuple[float, float, float]
    tensorboard_dir: Optional[str]
    peak_tflops: Optional[float]
    lora: Any = None  # megatron_glm5.lora.config.LoRAConfig with --lora-rank, else None


def _flag_defaults(args: argparse.Namespace) -> Dict[str, Any]:
    """The derived values that follow from the flags alone (no world size, hardware or model config): each rule
    is written here once.  The sections below start from these and check the flags; :func:`args_to_overrides`
    reads them too, so that an unvalidated namespace gets the same documented defaults (on a validated one they
    are the values already there)."""
    tp = args.tensor_model_parallel_size
    sp = args.sequence_parallel
    vpp = args.virtual_pipeline_model_parallel_size
    full = args.recompute_granularity == "full"
    return dict(
        expert_tensor_parallel_size=args.expert_tensor_parallel_size or 1,
        virtual_pipeline_model_parallel_size=None if vpp == 1 else vpp,
        sequence_parallel=tp > 1 if sp is None else bool(sp and tp > 1),  # on with --tp > 1; needs it
        moe_router_load_balancing_type=args.moe_router_load_balancing_type
        or ("seq_aux_loss" if args.moe_aux_loss_coeff > 0 else "none"),
        recompute_method=(args.recompute_method or "uniform") if full else args.recompute_method,
        recompute_num_layers=(args.recompute_num_layers or 1) if full else args.recompute_num_layers,
    )


def _check_precision(args: argparse.Namespace, cuda: bool, check_device: bool) -> Dict[str, Any]:
    import torch

    if getattr(args, "fp16", False):
        raise ArgumentError("--fp16 is not supported: GLM-5 trains in bf16 (use --bf16 on a GPU)", flag="--fp16")
    bf16 = cuda if args.bf16 is None else args.bf16
    if bf16 and check_device and not cuda:
        raise ArgumentError("--bf16 needs a CUDA GPU (none is visible); leave it out to train in fp32 on CPU",
                            flag="--bf16")
    if check_device and not cuda and args.attn not in ("auto", "torch"):
        raise ArgumentError(f"--attn {args.attn} needs a CUDA GPU (none is visible); use --attn torch or auto",
                            flag="--attn")
    if check_device and not cuda and args.moe_permute_fusion and os.environ.get("TRITON_INTERPRET") != "1":
        raise ArgumentError("--moe-permute-fusion needs a CUDA GPU (none is visible); leave it out or use "
                            "--no-moe-permute-fusion", flag="--moe-permute-fusion")
    return dict(bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32)


def _checkpoint_has_mtp(load: Optional[str]) -> Optional[bool]:
    """Whether the checkpoint --load names holds MTP weights (None: no --load, or its record cannot be read --
    loading it then says what is wrong)."""
    if not load or not os.path.isdir(load):
        return None
    from megatron_glm5.checkpoint.format import CheckpointFormatError, read_record

    try:
        return bool(read_record(load).mtp)
    except (CheckpointFormatError, OSError, ValueError):
        return None


def _check_model(args: argparse.Namespace) -> Dict[str, Any]:
    cfg = _load_model_config(args)
    has_mtp = cfg.num_nextn_predict_layers > 0
    if args.mtp and not has_mtp:
        raise ArgumentError("--mtp: the model config has no MTP layer (num_nextn_predict_layers is 0)", flag="--mtp")
    saved_mtp = _checkpoint_has_mtp(args.load) if has_mtp else None
    fresh_mtp = False
    if saved_mtp is False and args.mtp is None:  # e.g. a model saved by transformers: its config has MTP, no weights
        logger.info("--load %s holds no MTP weights: training without the MTP layer (pass --mtp to train a freshly "
                    "initialised one)", args.load)
        has_mtp = False
    elif saved_mtp is False and args.mtp:
        if not args.finetune:
            raise ArgumentError(f"--mtp: {args.load} holds no MTP weights, so a resume cannot continue one; start "
                                "a fresh MTP layer with --finetune, or leave --mtp out", flag="--mtp")
        logger.warning("--mtp: %s holds no MTP weights: the MTP layer starts freshly initialised", args.load)
        fresh_mtp = True
    return dict(model_config=cfg, mtp=has_mtp if args.mtp is None else args.mtp, fresh_mtp=fresh_mtp)


def _check_seq_length(args: argparse.Namespace, mtp: bool) -> None:
    """The shortest --seq-length the model trains on: one target per sequence (a fine-tuning sample also needs a
    prompt token before it), and with MTP a target --mtp-steps tokens further on."""
    finetune = getattr(args, "mode", "finetune") == "finetune"
    base = 2 if finetune else 1
    minimum = max(base, 1 + args.mtp_steps if mtp else 1)
    if args.seq_length < minimum:
        if minimum > base:
            why = (f"the MTP layer needs a target {args.mtp_steps} token(s) further on, --mtp-steps "
                   f"{args.mtp_steps}; --no-mtp lowers it to {base}")
        else:
            why = "a fine-tuning sample needs a prompt token and a target"
        raise ArgumentError(f"--seq-length {args.seq_length} is too short: the model trains on at least {minimum} "
                            f"tokens per sequence ({why})", flag="--seq-length")


def _config_error_to_flag(e: Exception) -> ArgumentError:
    msg = str(e)
    return ArgumentError(msg, flag=msg.split()[0] if msg.startswith("--") else None)


def _launch_hint(args: argparse.Namespace, world: int, needed: int) -> str:
    """How to launch a layout of ``needed`` ranks, for a layout error in a single process (else "")."""
    if world != 1:
        return ""
    script = getattr(args, "launch_script", None) or f"{getattr(args, 'mode', 'finetune')}_glm5.py"  # generate.py
    return (f"; this is a single process: launch {needed} with torchrun, e.g. torchrun --nproc-per-node {needed} "
            f"{script} <the same flags>")


def _check_parallel_layout(args: argparse.Namespace, world: int, cfg, flags: Dict[str, Any]) -> Dict[str, Any]:
    """Ranks over --tp/--pp/--cp and the expert layout, the pipeline split, sequence parallelism and the sequence
    length, the DDP overlap flags."""
    from megatron_glm5.config import ConfigError, check_cp_seq_length

    tp = args.tensor_model_parallel_size
    pp = args.pipeline_model_parallel_size
    cp = args.context_parallel_size
    ep = args.expert_model_parallel_size
    etp = flags["expert_tensor_parallel_size"]
    launch = _launch_hint(args, world, math.lcm(tp * pp * cp, etp * ep * pp))
    if world % (tp * pp * cp):
        raise ArgumentError(
            f"world size {world} is not divisible by --tp {tp} x --pp {pp} x --cp {cp} = {tp * pp * cp}{launch}",
            flag="--tp",
        )
    if world % (etp * ep * pp):
        raise ArgumentError(
            f"world size {world} is not divisible by --etp {etp} x --ep {ep} x --pp {pp} = {etp * ep * pp} "
            f"(the expert layout){launch}",
            flag="--ep",
        )
    vpp = args.virtual_pipeline_model_parallel_size
    if vpp is not None and pp == 1:
        raise ArgumentError(f"--vpp {vpp} needs --pp > 1 (virtual stages interleave pipeline stages)", flag="--vpp")
    vpp = flags["virtual_pipeline_model_parallel_size"]
    uneven = _check_pipeline_layout(args, cfg.num_hidden_layers, pp, vpp)
    try:  # heads by --tp, experts by --ep, expert width by --etp, layers by --pp (even split)
        cfg.validate_layout(tp=tp, pp=1 if uneven else pp, ep=ep, etp=etp, cp=cp)
    except ConfigError as e:
        raise _config_error_to_flag(e) from None

    if args.sequence_parallel and tp == 1:
        logger.warning("--sequence-parallel ignored: it needs --tp > 1")
    elif args.sequence_parallel is False and tp > 1:
        raise ArgumentError(
            f"--no-sequence-parallel with --tp {tp}: megatron-core's MoE layers need sequence parallelism "
            "when tensor parallelism is on",
            flag="--no-sequence-parallel",
        )
    sp = flags["sequence_parallel"]

    seq = args.seq_length
    try:
        check_cp_seq_length(seq, cp)
    except ConfigError as e:
        raise _config_error_to_flag(e) from None
    if sp and seq % (tp * cp):
        raise ArgumentError(
            f"--seq-length {seq} is not divisible by --tp {tp} x --cp {cp} = {tp * cp} (sequence parallelism "
            "splits each sequence over the tensor-parallel ranks)",
            flag="--seq-length",
        )
    if seq > cfg.max_position_embeddings:
        logger.warning("--seq-length %d exceeds the model's max_position_embeddings %d", seq,
                       cfg.max_position_embeddings)

    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise ArgumentError("--overlap-param-gather needs --use-distributed-optimizer", flag="--overlap-param-gather")
    if args.overlap_param_gather and not args.overlap_grad_reduce:
        raise ArgumentError("--overlap-param-gather needs --overlap-grad-reduce", flag="--overlap-param-gather")
    return dict(
        expert_tensor_parallel_size=etp,
        virtual_pipeline_model_parallel_size=vpp,
        data_parallel_size=world // (tp * pp * cp),
        expert_data_parallel_size=world // (etp * ep * pp),
        sequence_parallel=sp,
    )


def _check_hybridep(args: argparse.Namespace, world: int, etp: int) -> Dict[str, Any]:
    """--node-size (default: min(world size, 8)) against the world size and the expert-parallel group."""
    node_size = min(world, 8) if args.node_size is None else args.node_size
    ep = args.expert_model_parallel_size
    if args.moe_token_dispatcher_type == "hybridep" and world > node_size and world % node_size:
        raise ArgumentError(
            f"--node-size {node_size} does not divide the world size {world} (hybridep needs whole nodes)",
            flag="--node-size",
        )
    ep_width = ep * etp  # consecutive ranks of one expert-parallel group (expert TP innermost)
    if args.moe_token_dispatcher_type == "hybridep" and ep_width % node_size and node_size % ep_width:
        raise ArgumentError(
            f"--node-size {node_size} does not divide --ep {ep}"
            + (f" x --etp {etp} = {ep_width}" if etp > 1 else "")
            + " (hybridep groups each expert-parallel group into whole nodes; a group inside one node needs "
            "--node-size to be a multiple of it)",
            flag="--node-size",
        )
    return dict(node_size=node_size)


def _check_batch(args: argparse.Namespace, world: int, dp: int) -> Dict[str, Any]:
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    mbs = args.micro_batch_size
    gbs = mbs * dp if args.global_batch_size is None else args.global_batch_size
    if gbs % (mbs * dp):
        raise ArgumentError(
            f"--global-batch-size {gbs} is not divisible by --micro-batch-size {mbs} x data-parallel size {dp} "
            f"= {mbs * dp} (data-parallel size = world size {world} / (--tp {tp} x --pp {pp} x --cp {cp}))",
            flag="--global-batch-size",
        )
    num_microbatches = gbs // (mbs * dp)
    if pp > 1 and num_microbatches < pp:
        logger.warning("%d micro-batches per step for %d pipeline stages: most of each step is pipeline bubble",
                       num_microbatches, pp)
    return dict(global_batch_size=gbs, num_microbatches=num_microbatches)


def _check_dsa(args: argparse.Namespace) -> None:
    if args.dsa_indexer_loss_coeff < 0:
        raise ArgumentError(f"--dsa-indexer-loss-coeff must be >= 0, got {args.dsa_indexer_loss_coeff:g}",
                            flag="--dsa-indexer-loss-coeff")
    if args.dsa_stage == "dense-warmup" and args.dsa_indexer_loss_coeff == 0:
        raise ArgumentError(
            "--dsa-stage dense-warmup with --dsa-indexer-loss-coeff 0 trains nothing (the warm-up trains only the "
            "indexer, through its loss)",
            flag="--dsa-indexer-loss-coeff",
        )
    if args.freeze_indexer and args.dsa_stage == "dense-warmup":
        raise ArgumentError(
            "--freeze-indexer with --dsa-stage dense-warmup leaves nothing to train (the warm-up trains only the "
            "indexer)",
            flag="--freeze-indexer",
        )


def _check_moe(args: argparse.Namespace, flags: Dict[str, Any]) -> Dict[str, Any]:
    if args.moe_aux_loss_coeff < 0:
        raise ArgumentError(f"--moe-aux-loss-coeff must be >= 0, got {args.moe_aux_loss_coeff:g}",
                            flag="--moe-aux-loss-coeff")
    if args.moe_router_load_balancing_type == "none" and args.moe_aux_loss_coeff > 0:
        raise ArgumentError(
            f"--moe-aux-loss-coeff {args.moe_aux_loss_coeff:g} has no effect with "
            "--moe-router-load-balancing-type none",
            flag="--moe-router-load-balancing-type",
        )
    if args.moe_router_bias_update_rate < 0:
        raise ArgumentError(f"--moe-router-bias-update-rate must be >= 0, got {args.moe_router_bias_update_rate:g}",
                            flag="--moe-router-bias-update-rate")
    return dict(moe_router_load_balancing_type=flags["moe_router_load_balancing_type"])


def _check_schedule(args: argparse.Namespace) -> Dict[str, Any]:
    """Optimizer and LR schedule: warm-up (--lr-warmup-iters, --lr-warmup-fraction or the default), decay, WSD."""
    if args.lr < args.min_lr:
        raise ArgumentError(f"--lr {args.lr:g} is smaller than --min-lr {args.min_lr:g}", flag="--lr")
    for flag, v in (("--adam-beta1", args.adam_beta1), ("--adam-beta2", args.adam_beta2)):
        if not 0.0 <= v < 1.0:
            raise ArgumentError(f"{flag} must be in [0, 1), got {v:g}", flag=flag)
    train_iters = args.train_iters
    decay_iters = train_iters if args.lr_decay_iters is None else args.lr_decay_iters
    explicit_warmup = args.lr_warmup_iters is not None
    if explicit_warmup and args.lr_warmup_fraction is not None:
        raise ArgumentError("--lr-warmup-iters and --lr-warmup-fraction are exclusive; give one",
                            flag="--lr-warmup-fraction")
    if args.lr_warmup_fraction is not None:
        warmup = int(round(args.lr_warmup_fraction * decay_iters))
        warmup_flag = "--lr-warmup-fraction"
    elif explicit_warmup:
        warmup, warmup_flag = args.lr_warmup_iters, "--lr-warmup-iters"
    else:
        warmup, warmup_flag = min(DEFAULT_LR_WARMUP_ITERS, train_iters // 10), "--lr-warmup-iters"
    if warmup > train_iters:
        raise ArgumentError(
            f"{warmup_flag}: {warmup} warm-up iterations exceed --train-iters {train_iters}",
            flag=warmup_flag,
        )
    if args.lr_decay_style != "constant" and warmup >= decay_iters:
        raise ArgumentError(
            f"{warmup_flag}: {warmup} warm-up iterations leave nothing of --lr-decay-iters "
            f"{decay_iters} to decay over",
            flag=warmup_flag,
        )
    wsd_iters = args.lr_wsd_decay_iters
    if args.lr_decay_style == "WSD":
        if wsd_iters is None:
            wsd_iters = max(1, decay_iters // 10)
        if wsd_iters > decay_iters - warmup:
            raise ArgumentError(
                f"--lr-wsd-decay-iters {wsd_iters} exceeds the {decay_iters - warmup}"
                " iterations after warm-up",
                flag="--lr-wsd-decay-iters",
            )
    return dict(lr_decay_iters=decay_iters, lr_warmup_iters=warmup, lr_wsd_decay_iters=wsd_iters)


def _check_recompute(args: argparse.Namespace, flags: Dict[str, Any]) -> Dict[str, Any]:
    gran, method, nlayers, modules = (args.recompute_granularity, args.recompute_method,
                                      args.recompute_num_layers, args.recompute_modules)
    if modules is not None:
        if "router" in modules:
            raise ArgumentError(
                "--recompute-modules router: the MoE router is never recomputed (its top-k choice must not change "
                "between the forward pass and the recompute); drop 'router'",
                flag="--recompute-modules",
            )
        bad = [m for m in modules if m not in RECOMPUTE_MODULES]
        if bad:
            raise ArgumentError(
                f"--recompute-modules: unknown module(s) {', '.join(bad)}; choose from {', '.join(RECOMPUTE_MODULES)}",
                flag="--recompute-modules",
            )
        if gran != "selective":
            raise ArgumentError("--recompute-modules needs --recompute-granularity selective",
                                flag="--recompute-modules")
    if gran is None:
        for flag, v in (("--recompute-method", method), ("--recompute-num-layers", nlayers)):
            if v is not None:
                raise ArgumentError(f"{flag} needs --recompute-granularity full", flag=flag)
    elif gran == "selective":
        for flag, v in (("--recompute-method", method), ("--recompute-num-layers", nlayers)):
            if v is not None:
                raise ArgumentError(f"{flag} applies to --recompute-granularity full only, not selective", flag=flag)
    return dict(recompute_method=flags["recompute_method"], recompute_num_layers=flags["recompute_num_layers"])


def _warn_repeated_paths(flag: str, blend) -> None:
    """A path listed twice in a blend is read twice (its samples drawn twice as often): say so, once per path."""
    seen: Dict[str, str] = {}
    for path in (blend[0] if blend else []):
        key = os.path.realpath(path)
        if key in seen:
            logger.warning("%s lists %s twice (also as %s): its samples are drawn twice as often; list it once, or "
                           "give blend weights", flag, path, seen[key])
        else:
            seen[key] = path


def _check_data(args: argparse.Namespace) -> Dict[str, Any]:
    derived = dict(
        data_blend=parse_data_blend(args.data_path, "--data-path"),
        valid_data_blend=parse_data_blend(args.valid_data_path, "--valid-data-path"),
        split_fractions=_parse_split(args.split),
    )
    if not str(args.tokenizer).strip():
        raise ArgumentError("--tokenizer is empty", flag="--tokenizer")
    if getattr(args, "mode", "finetune") == "pretrain" and derived["split_fractions"][0] == 0:
        raise ArgumentError(f"--split {args.split} gives the training split no share of --data-path (e.g. "
                            "--split 98,1,1)", flag="--split")
    for flag, blend in (("--data-path", derived["data_blend"]), ("--valid-data-path", derived["valid_data_blend"])):
        _warn_repeated_paths(flag, blend)
    return derived


def _check_checkpoints_and_logging(args: argparse.Namespace, cuda: bool) -> Dict[str, Any]:
    if args.finetune and not args.load:
        raise ArgumentError("--finetune needs --load (the checkpoint whose weights to start from)", flag="--finetune")
    if args.eval_only and not (args.load or args.resume):
        raise ArgumentError("--eval-only needs --load (the checkpoint to evaluate)", flag="--eval-only")
    if args.eval_only and args.eval_iters == 0:
        raise ArgumentError("--eval-only with --eval-iters 0 evaluates nothing", flag="--eval-iters")
    if args.resume and args.finetune:
        raise ArgumentError("--resume continues a run (model, optimizer, schedule); --finetune starts a new one "
                            "from --load's weights: choose one", flag="--resume")
    if args.overwrite and args.resume:
        raise ArgumentError("--overwrite deletes the run in --save; --resume continues it: choose one",
                            flag="--overwrite")
    tensorboard_dir = args.tensorboard_dir
    if tensorboard_dir is None and args.save:
        tensorboard_dir = os.path.join(args.save, "tensorboard")
    peak_tflops = DEFAULT_PEAK_TFLOPS if args.peak_tflops is None and cuda else args.peak_tflops
    return dict(tensorboard_dir=tensorboard_dir, peak_tflops=peak_tflops)


def derive_args(args: argparse.Namespace, world_size: Optional[int] = None,
                check_device: bool = True) -> DerivedArgs:
    """Check ``args`` for ``world_size`` ranks section by section (the order decides which mistake is reported
    first) and return the :class:`DerivedArgs`; ``args`` is not changed.  See :func:`validate_args`."""
    world = _resolve_world_size(world_size)
    cuda = _cuda_available()
    flags = _flag_defaults(args)
    d: Dict[str, Any] = dict(world_size=world)
    d.update(_check_precision(args, cuda, check_device))
    d.update(_check_model(args))
    _check_seq_length(args, d["mtp"])
    d.update(_check_parallel_layout(args, world, d["model_config"], flags))
    d.update(_check_hybridep(args, world, d["expert_tensor_parallel_size"]))
    d.update(_check_batch(args, world, d["data_parallel_size"]))
    _check_dsa(args)
    d.update(_check_moe(args, flags))
    d.update(_check_schedule(args))
    d.update(_check_recompute(args, flags))
    d.update(memory_options.check(args, d["bf16"]))
    d.update(_check_data(args))
    d.update(_check_checkpoints_and_logging(args, cuda))
    muon_flags.check(args)
    manual_gc.check(args)
    d.update(lora_flags.check(args, d))
    d.update(fp8_flags.check(args, d["model_config"], cuda, check_device))
    return DerivedArgs(**d)


def validate_args(args: argparse.Namespace, world_size: Optional[int] = None,
                  check_device: bool = True) -> argparse.Namespace:
    """Check ``args`` for ``world_size`` ranks (default ``$WORLD_SIZE`` or 1) and fill the derived fields.

    Raises :class:`ArgumentError` with one message naming the flag(s) at the first mistake.  ``check_device=False``
    skips the checks that need the local hardware (``--bf16`` / GPU-only ``--attn`` without CUDA), to validate a
    recipe for a cluster from a laptop.  Writes every field of :func:`derive_args`'s :class:`DerivedArgs` onto
    ``args`` (nothing when a check fails) and returns it.  Idempotent.
    """
    derived = derive_args(args, world_size, check_device)
    for f in dataclasses.fields(derived):
        setattr(args, f.name, getattr(derived, f.name))
    return args


# --------------------------------------------------------------------------------------------------------------
# megatron-core mapping
# --------------------------------------------------------------------------------------------------------------


def args_to_overrides(args: argparse.Namespace) -> Dict[str, Any]:
    """The ``GLM5Config.to_transformer_config(**overrides)`` keyword arguments for the model-related flags
    (megatron-core 0.19.2 TransformerConfig names, plus GLM5TransformerConfig's ``dsa_*`` fields).

    Reads the values :func:`validate_args` derived; on unvalidated args the unresolved "auto" values get their
    documented defaults (:func:`_flag_defaults`; bf16 stays off).  ``moe_token_dispatcher_type`` is passed
    verbatim, so "hybridep" (not a megatron-core dispatcher type) is the model builder's to translate.
    """
    import torch

    bf16 = bool(args.bf16)
    flags = _flag_defaults(args)
    overrides: Dict[str, Any] = dict(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=flags["virtual_pipeline_model_parallel_size"],
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=flags["expert_tensor_parallel_size"],
        context_parallel_size=args.context_parallel_size,
        sequence_parallel=flags["sequence_parallel"],
        params_dtype=getattr(args, "params_dtype", None) or (torch.bfloat16 if bf16 else torch.float32),
        bf16=bf16,
        dsa_stage=args.dsa_stage,
        dsa_indexer_loss_coeff=float(args.dsa_indexer_loss_coeff),
        dsa_freeze_indexer=bool(args.freeze_indexer) or lora_flags.freezes_indexer(args),
        dsa_backend=args.attn,
        moe_aux_loss_coeff=float(args.moe_aux_loss_coeff),
        moe_router_load_balancing_type=flags["moe_router_load_balancing_type"],
        # the dense warm-up trains the indexers alone: the routers' expert bias stays as loaded, too
        moe_router_bias_update_rate=(0.0 if args.dsa_stage == "dense-warmup" or lora_flags.keeps_router_bias(args)
                                     else float(args.moe_router_bias_update_rate)),
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        mtp_loss_scaling_factor=float(args.mtp_loss_scaling_factor),
        recompute_granularity=args.recompute_granularity,
        recompute_method=flags["recompute_method"],
        recompute_num_layers=flags["recompute_num_layers"],
        recompute_modules=list(args.recompute_modules) if args.recompute_modules is not None else None,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        calculate_per_token_loss=True,
        # megatron-core's bf16 optimizers need one parameter dtype (fp32 master copies are kept for all)
        fp32_router_and_indexer_weights=not args.bf16,
    )
    overrides.update(cross_entropy_flags.config_overrides(getattr(args, "cross_entropy_fusion", "none")))
    overrides.update(fusion_flags.config_overrides(getattr(args, "fusions", "auto")))
    if args.moe_router_dtype is not None:
        overrides["moe_router_dtype"] = args.moe_router_dtype
    if getattr(args, "moe_permute_fusion", None) is not None:  # None: the model's default (on with CUDA + triton)
        overrides["moe_triton_permute_fusion"] = args.moe_permute_fusion
    if args.moe_token_dispatcher_type == "hybridep" and args.node_size is not None:
        overrides["moe_hybridep_node_size"] = args.node_size
    if args.mtp is False:
        overrides["mtp_num_layers"] = None
    elif args.mtp_steps > 1:
        if args.model_config.num_nextn_predict_layers != 1:
            raise ArgumentError("--mtp-steps needs a model with exactly one MTP module (num_nextn_predict_layers 1)",
                                flag="--mtp-steps")
        overrides.update(mtp_num_layers=args.mtp_steps, mtp_use_repeated_layer=True)
    return overrides


# --------------------------------------------------------------------------------------------------------------
# Entry-script guard
# --------------------------------------------------------------------------------------------------------------

TRACEBACK_ENV = "MEGATRON_GLM5_TRACEBACK"


def is_user_error(exc: BaseException) -> bool:
    """True for errors the user fixes: :class:`UserError`, and ValueError / ImportError subclasses defined in
    this package (ConfigError, DataError, BackendUnavailable, ...)."""
    if isinstance(exc, UserError):
        return True
    if not isinstance(exc, (ValueError, ImportError)):
        return False
    return any((getattr(c, "__module__", "") or "").split(".")[0] == "megatron_glm5" for c in type(exc).__mro__)


def _exit_status(exc: BaseException) -> Optional[int]:
    """2 for a user error, 3 for a lost or stopped peer rank (training/watchdog.py's JobFailure), else None
    (a bug: the traceback stays)."""
    if is_user_error(exc):
        return 2
    from megatron_glm5.training.watchdog import JobFailure

    return JobFailure.exit_status if isinstance(exc, JobFailure) else None


# seconds a rank that does not print a flag error (not rank 0) waits before it exits (under torchrun, a worker that
# exits first makes torchrun stop the others, rank 0 perhaps before it printed: seen on a loaded 2-core machine)
SILENT_RANK_GRACE_S = 5.0


def _report(exc: BaseException) -> None:
    """Print the one line (rank 0 alone for a flag error under torchrun: every rank sees the same flags; other
    ranks' lines prefixed ``[rank N]``) and give it to torchrun for its failure summary (torchrun_report.py)."""
    from megatron_glm5.torchrun_report import write_error_file
    from megatron_glm5.training.watchdog import JobFailure

    message = " ".join(str(exc).split("\n")).strip() or type(exc).__name__
    rank = os.environ.get("RANK")
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        world = 1
    silent = False
    if world > 1 and rank not in (None, "0"):
        silent = isinstance(exc, ArgumentError)
        if not silent and not isinstance(exc, JobFailure):  # a JobFailure's message starts with its rank
            message = f"[rank {rank}] {message}"
    write_error_file(f"error: {message}")
    if not silent:
        print(f"error: {message}", file=sys.stderr, flush=True)
    else:  # torchrun stops every worker once one exits: leave rank 0 the time to print the line first
        time.sleep(SILENT_RANK_GRACE_S)


class _Guard(contextlib.AbstractContextManager):
    def __exit__(self, exc_type, exc, tb):
        status = None if exc is None else _exit_status(exc)
        if status is None or os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            return False
        _report(exc)
        if status != 2:  # a peer is gone: this process's distributed state cannot be torn down cleanly
            sys.stdout.flush()
            os._exit(status)
        sys.exit(status)


def main_guard(fn: Optional[Callable] = None):
    """Print user errors as one line ``error: <message>`` on stderr and exit with status 2 (no traceback).

    A decorator (``@main_guard`` on ``main``) or, called without a function, a context manager
    (``with main_guard(): ...``).  A lost or stopped peer rank (training/watchdog.py's ``JobFailure``) is one line
    too, with exit status 3.  Other exceptions propagate unchanged; ``MEGATRON_GLM5_TRACEBACK=1`` keeps the
    traceback for user errors too.  Under torchrun, rank 0 alone reports an :class:`ArgumentError`, and every
    failing rank writes its line into torchrun's error file (torchrun_report.py).
    """
    if fn is None:
        return _Guard()

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        with _Guard():
            return fn(*a, **kw)

    return wrapper
