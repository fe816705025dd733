"""Command lines of tools/convert_hf_to_megatron.py, tools/convert_megatron_to_hf.py and tools/verify_conversion.py.

Each ``*_main(argv)`` returns the exit status: 0 on success, 2 with one line ``error: <message>`` on stderr for a
problem the user can fix (bad flag, missing/truncated shard, wrong architecture, dtype, layout), 1 when
verification finds a difference. ``MEGATRON_GLM5_TRACEBACK=1`` keeps tracebacks.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys


from megatron_glm5.conversion.parallel import add_workers_flag


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        from megatron_glm5.conversion.convert import ConversionError
        raise ConversionError(f"{message} (see {self.prog} --help)")


def _guard(fn, argv) -> int:
    from megatron_glm5.config import ConfigError
    from megatron_glm5.conversion.safetensors_io import CheckpointError
    from megatron_glm5.errors import UserError

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stderr)
    for noisy in ("megatron.core", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    import warnings
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core")
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    try:
        code = fn(argv)
        from megatron_glm5 import platform
        platform.end_of_job()  # the ranks of a parallel conversion exit cleanly (platform.end_of_job)
        return code
    except (UserError, ConfigError, CheckpointError) as e:
        if os.environ.get("MEGATRON_GLM5_TRACEBACK") == "1":
            raise
        msg = " ".join(str(e).split())
        print(f"error: {msg}", file=sys.stderr)
        return 2


def _summary(result: dict) -> None:
    gib = result["bytes"] / 2 ** 30
    print(f"wrote {result['output']}: {result['tensors']} tensors, {gib:.2f} GiB in {result['seconds']:.1f} s "
          f"({result['mb_per_s']:.0f} MiB/s), peak RSS {result['peak_rss_bytes'] / 2 ** 30:.2f} GiB"
          + (f"; {result['workers']} workers, peak RSS per worker up to "
             f"{max(result['worker_peak_rss_bytes']) / 2 ** 30:.2f} GiB" if result.get("workers", 1) > 1 else ""))
    print("summary " + json.dumps(result, sort_keys=True))


# ---------------------------------------------------------------- HF -> megatron
def hf_to_megatron_parser():
    p = _Parser(prog="convert_hf_to_megatron.py",
                description="Convert an HF GLM-5 checkpoint (bf16/fp32, or FP8 e4m3 with 128x128 block scales) into a "
                            "megatron-core torch_dist checkpoint that `finetune_glm5.py --load OUT --finetune` "
                            "reads. torch_dist stores global tensors, so one conversion serves every parallel "
                            "layout; --tp/--pp/--ep/--etp are checked against the model and recorded.")
    p.add_argument("--hf-dir", required=True, metavar="DIR", help="HF model directory (config.json + safetensors)")
    p.add_argument("--save", required=True, metavar="OUT", help="output checkpoint directory (must not exist)")
    p.add_argument("--tp", "--tensor-model-parallel-size", type=int, default=1, metavar="N")
    p.add_argument("--pp", "--pipeline-model-parallel-size", type=int, default=1, metavar="N")
    p.add_argument("--ep", "--expert-model-parallel-size", type=int, default=1, metavar="N")
    p.add_argument("--etp", "--expert-tensor-parallel-size", type=int, default=None, metavar="N",
                   help="expert tensor parallel size (default: --tp)")
    p.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp16", "fp32"),
                   help="stored dtype: auto keeps each tensor's dtype (FP8 -> bf16); the router weight and expert "
                        "bias are never narrowed below fp32 (default: auto)")
    p.add_argument("--mtp", action=argparse.BooleanOptionalAction, default=None,
                   help="convert the MTP layer (default: when the checkpoint has it)")
    p.add_argument("--keep-fp8", action="store_true",
                   help="an FP8 release: keep its e4m3 weights and weight_scale_inv blocks as they are (bitwise), "
                        "for training with --base-precision fp8 (docs/fp8.md); without it FP8 is dequantised")
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="convert weights with NaN/Inf values (each such tensor is named in a warning); without it "
                        "they stop the conversion")
    p.add_argument("--overwrite", action="store_true", help="replace --save if it exists (after a successful write)")
    p.add_argument("--max-chunk-size", default="64MiB", metavar="SIZE",
                   help="largest block held in memory; bigger tensors are stored as several chunks (default: 64MiB)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_workers_flag(p)
    return p


def _hf_to_megatron(argv) -> int:
    from megatron_glm5.conversion.convert import convert_hf_to_megatron
    from megatron_glm5.conversion.safetensors_stream import parse_size

    args = hf_to_megatron_parser().parse_args(argv)
    result = convert_hf_to_megatron(args.hf_dir, args.save, tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp,
                                    dtype=args.dtype, mtp=args.mtp, overwrite=args.overwrite,
                                    progress=not args.no_progress, max_chunk_bytes=parse_size(args.max_chunk_size),
                                    allow_nonfinite=args.allow_nonfinite, workers=args.workers,
                                    keep_fp8=args.keep_fp8)
    _summary(result)
    return 0


def hf_to_megatron_main(argv=None) -> int:
    return _guard(_hf_to_megatron, argv)


# ---------------------------------------------------------------- megatron -> HF
def megatron_to_hf_parser():
    p = _Parser(prog="convert_megatron_to_hf.py",
                description="Export a megatron-glm5 torch_dist checkpoint (a --save root, an iter_XXXXXXX directory "
                            "or a converted checkpoint) as an HF directory that transformers and vLLM load. Only the "
                            "model weights are read, never the optimizer state.")
    p.add_argument("--load", required=True, metavar="CKPT", help="checkpoint directory")
    p.add_argument("--save", required=True, metavar="DIR", help="output HF directory (must not exist)")
    p.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp16", "fp32", "fp8"),
                   help="output dtype: auto keeps the stored dtypes (an FP8 base stays FP8); fp8 writes the "
                        "GLM-5-FP8 release's layout (e4m3 + 128x128 weight_scale_inv, quantization_config; "
                        "docs/fp8.md); e_score_correction_bias stays fp32 (default: auto)")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE", help="safetensors shard size (default: 5GB)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="copy the tokenizer files of this HF directory (or 'tiny' for the shipped test tokenizer)")
    p.add_argument("--overwrite", action="store_true", help="replace --save if it exists (after a successful write)")
    p.add_argument("--max-block-size", default="64MiB", metavar="SIZE",
                   help="largest block held in memory (default: 64MiB)")
    p.add_argument("--mtp", action=argparse.BooleanOptionalAction, default=None,
                   help="write the MTP layer (HF layer num_hidden_layers; default: when the checkpoint has it). "
                        "--no-mtp leaves it out: transformers' GlmMoeDsaForCausalLM has no MTP module")
    _add_no_verify(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--merge-lora", default=None, metavar="ADAPTERS",
                   help="merge this LoRA adapter checkpoint into --load (the base) and write the merged model. "
                        "--load of an adapter checkpoint alone writes a PEFT directory (docs/lora.md)")
    add_workers_flag(p)
    return p


def _add_no_verify(p):
    p.add_argument("--no-verify", action="store_true",
                   help="do not check the checkpoint against its manifest.json (every file's size and checksum; "
                        "reads each file once); by default a damaged checkpoint is refused")


def _megatron_to_hf(argv) -> int:
    from megatron_glm5.conversion.convert import convert_megatron_to_hf
    from megatron_glm5.conversion.safetensors_stream import parse_size

    args = megatron_to_hf_parser().parse_args(argv)
    from megatron_glm5.lora import export as lora_export
    if not args.merge_lora and lora_export.is_adapter_checkpoint(args.load):  # adapters alone: a PEFT directory
        _summary(lora_export.write_peft(args.load, args.save, dtype=lora_export.peft_dtype(args.dtype),
                                        overwrite=args.overwrite))
        return 0
    result = convert_megatron_to_hf(args.load, args.save, dtype=args.dtype, max_shard_size=args.max_shard_size,
                                    tokenizer=args.tokenizer, overwrite=args.overwrite,
                                    progress=not args.no_progress, max_block_bytes=parse_size(args.max_block_size),
                                    mtp=args.mtp, verify=not args.no_verify, workers=args.workers,
                                    wrap_reader=(lora_export.merge_into(args.merge_lora) if args.merge_lora else None))
    _summary(result)
    return 0


def megatron_to_hf_main(argv=None) -> int:
    return _guard(_megatron_to_hf, argv)


# ---------------------------------------------------------------- verify
def verify_parser():
    p = _Parser(prog="verify_conversion.py",
                description="Compare an HF directory with a torch_dist checkpoint: every tensor (streamed, bitwise "
                            "when dtypes agree), and optionally the logits on a prompt of our model loaded from each "
                            "side (and of transformers' model).")
    p.add_argument("--hf-dir", required=True, metavar="DIR")
    p.add_argument("--megatron", "--load", dest="megatron", required=True, metavar="CKPT")
    p.add_argument("--logits", action="store_true",
                   help="also compare logits: our model from the HF dir vs from the torch_dist checkpoint (builds "
                        "both models in memory: tiny / small models only)")
    p.add_argument("--transformers", action="store_true", help="with --logits: also transformers' model")
    p.add_argument("--prompt-length", type=int, default=32)
    p.add_argument("--atol", type=float, default=0.0,
                   help="tensor tolerance when dtypes differ (equal dtypes are compared bitwise)")
    p.add_argument("--logits-rtol", type=float, default=1e-5, help="relative L2 tolerance of the logits")
    _add_no_verify(p)
    return p


def _verify(argv) -> int:
    from megatron_glm5.conversion.verify import compare_logits, compare_tensors

    args = verify_parser().parse_args(argv)
    if args.no_verify:
        logging.getLogger("megatron_glm5.conversion").warning(
            "--no-verify: the checkpoint is not checked against its manifest")
    report = compare_tensors(args.hf_dir, args.megatron, atol=args.atol, verify=not args.no_verify)
    print(f"tensors: {report['identical']} identical, {report['close']} within --atol, "
          f"{len(report['different'])} different (of {report['total']})")
    for line in report["different"][:10]:
        print(f"  DIFFERENT {line}")
    ok = not report["different"]
    if args.logits:
        logits = compare_logits(args.hf_dir, args.megatron, transformers=args.transformers,
                                prompt_length=args.prompt_length)
        for name, value in logits.items():
            good = value <= args.logits_rtol
            ok &= good
            print(f"logits {name}: relative L2 {value:.3e} {'ok' if good else 'TOO LARGE'}")
    print("verify: OK" if ok else "verify: FAILED")
    return 0 if ok else 1


def verify_main(argv=None) -> int:
    return _guard(_verify, argv)
