"""The command line of tools/generate.py: text generation, or --eval perplexity, from a checkpoint.

    python tools/generate.py --load runs/sft --prompt "What is 3 plus 4?" --chat --greedy
    python tools/generate.py --hf-dir /models/GLM-5.3 --prompts-file prompts.jsonl --temperature 0.7 --top-p 0.95
    python tools/generate.py --load runs/sft --eval held_out.jsonl

    torchrun --nproc-per-node 4 tools/generate.py --load runs/sft --tp 2 --pp 2 --prompt "Hi" --greedy

One process (python): the checkpoint (any layout it was trained at) is loaded whole into one model
(api.load_checkpoint / api.from_hf_pretrained), without its MTP layer. Under torchrun, or with a layout flag
(--tp/--pp/--ep/...): the training scripts' layout, model and checkpoint loading, each rank decoding its part
(generation/parallel.py). docs/generation.md is the guide.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import List, Optional, Sequence

from megatron_glm5.arguments import ArgumentError

DEFAULT_BATCH = 8


class GenerateError(ArgumentError):
    """A flag or input of tools/generate.py the user must change (under torchrun rank 0 alone reports it)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise GenerateError(f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    from megatron_glm5.ops.registry import ATTN_CHOICES

    p = _Parser(prog="generate.py", description="Generate text from a megatron-glm5 checkpoint, or measure its "
                "perplexity on a jsonl file (--eval). See docs/generation.md.")
    src = p.add_argument_group("model")
    src.add_argument("--load", metavar="DIR", help="a training checkpoint: a --save root or an iter_XXXXXXX "
                     "directory, saved at any parallel layout")
    src.add_argument("--hf-dir", metavar="DIR", help="a Hugging Face GlmMoeDsa directory (config.json + safetensors)")
    src.add_argument("--tokenizer", metavar="PATH", help="tokenizer directory, .model file or 'tiny' (default: "
                     "--hf-dir when it holds tokenizer.json, else 'tiny')")
    src.add_argument("--attn", default="torch", choices=ATTN_CHOICES, help="attention backend (default: the torch "
                     "reference; see docs/generation.md for the GPU backends)")
    src.add_argument("--dtype", choices=("fp32", "bf16"), help="weights and activations (default: bf16 on a GPU, "
                     "fp32 on CPU)")
    src.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    src.add_argument("--no-verify", action="store_true", help="load a --load checkpoint without checking its "
                     "files against the manifest")
    inp = p.add_argument_group("prompts")
    inp.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a prompt (repeatable)")
    inp.add_argument("--prompts-file", metavar="FILE", help="jsonl, one {\"prompt\": ...} or {\"messages\": [...]} "
                     "per line (messages always go through the chat template)")
    inp.add_argument("--chat", action="store_true", help="send each --prompt / \"prompt\" as a user turn through the "
                     "tokenizer's chat template (ends with <|assistant|>)")
    gen = p.add_argument_group("generation")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--greedy", action="store_true", help="always the most likely token (as --temperature 0)")
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the most likely tokens up to "
                     "this probability (1: all)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    gen.add_argument("--seed", type=int, help="sampling seed (default: random, printed)")
    gen.add_argument("--batch-size", type=int, default=DEFAULT_BATCH, help="prompts decoded together")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    gen.add_argument("--dump-logits", metavar="FILE", help="debugging: save every step's logits (torch.save: one "
                     "[batch, vocab] fp32 tensor per step, batch after batch) of the rank that samples")
    ev = p.add_argument_group("evaluation")
    ev.add_argument("--eval", metavar="FILE", help="perplexity on a jsonl of {\"text\": ...} / {\"messages\": "
                    "[...]} records instead of generating")
    from megatron_glm5.generation import parallel
    parallel.add_flags(p)
    return p


def _check_args(args) -> None:
    from megatron_glm5.generation import parallel

    world = parallel.world_size()
    args.parallel = parallel.requested(args, world)
    if args.parallel:
        parallel.check_flags(args, world)
    if (args.load is None) == (args.hf_dir is None):
        raise GenerateError("give exactly one of --load (a training checkpoint) or --hf-dir (a converted HF "
                            "directory)")
    for flag, path in (("--load", args.load), ("--hf-dir", args.hf_dir)):
        if path is not None and not os.path.isdir(path):
            raise GenerateError(f"{flag} {path}: no such directory")
    if args.eval is None and not args.prompt and args.prompts_file is None:
        raise GenerateError("nothing to do: give --prompt TEXT, --prompts-file FILE.jsonl or --eval FILE.jsonl")
    if args.eval is not None and (args.prompt or args.prompts_file):
        raise GenerateError("--eval measures perplexity on its file: drop --prompt / --prompts-file (or run twice)")
    for flag, path in (("--prompts-file", args.prompts_file), ("--eval", args.eval)):
        if path is not None and not os.path.isfile(path):
            raise GenerateError(f"{flag} {path}: no such file")
    if args.max_new_tokens < 1:
        raise GenerateError(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
    if args.batch_size < 1:
        raise GenerateError(f"--batch-size {args.batch_size}: must be >= 1")
    from megatron_glm5.ops.registry import get_backend
    get_backend(args.attn)  # a backend that cannot run here: its one-line reason, before the model is built
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise GenerateError("--device cuda: no CUDA GPU in this process; use --device cpu")


def _load(args):
    """(model, stage): the whole model in this process (stage None), or this rank's part of a parallel layout."""
    import torch

    if args.parallel:
        from megatron_glm5.generation import parallel
        return parallel.load_model(parallel.check(args, parallel.world_size()))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype or ("bf16" if device == "cuda" else "fp32")]
    from megatron_glm5.api import from_hf_pretrained, load_checkpoint

    if args.load is not None:
        model = load_checkpoint(args.load, dtype=dtype, device=device, mtp=False, verify=not args.no_verify,
                                dsa_backend=args.attn)
    else:
        model = from_hf_pretrained(args.hf_dir, dtype=dtype, device=device, mtp=False, dsa_backend=args.attn)
    return model, None


class _DropTooLongWarning(logging.Filter):
    """transformers warns that a prompt is longer than the tokenizer's model_max_length; what counts here is the
    model's max_position_embeddings, which check_prompts enforces with its own one-line error."""

    def filter(self, record):
        return not record.getMessage().startswith("Token indices sequence length is longer than")


def _tokenizer(args, model):
    from megatron_glm5.data.tokenizer import load_tokenizer

    hf_logger = logging.getLogger("transformers.tokenization_utils_base")
    if not any(isinstance(f, _DropTooLongWarning) for f in hf_logger.filters):
        hf_logger.addFilter(_DropTooLongWarning())

    name = args.tokenizer
    if name is None:
        has_own = args.hf_dir is not None and os.path.isfile(os.path.join(args.hf_dir, "tokenizer.json"))
        name = args.hf_dir if has_own else "tiny"
    tok = load_tokenizer(name)
    vocab = int(model.config.vocab_size)
    if tok.vocab_size > vocab:
        raise GenerateError(f"--tokenizer {name}: {tok.vocab_size} token ids, the model's vocabulary has {vocab}: "
                            "pass the model's own tokenizer with --tokenizer")
    return tok


def _encode(tok, text: str, chat: bool, where: str) -> List[int]:
    if not text.strip():
        raise GenerateError(f"{where}: empty prompt; give it some text")
    if chat:
        return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return tok.encode(text)


def read_prompts(args, tok) -> List[tuple]:
    """(label, token ids) of every prompt, --prompt ones first."""
    prompts = [(text, _encode(tok, text, args.chat, f"--prompt {i + 1}")) for i, text in enumerate(args.prompt)]
    if args.prompts_file is not None:
        from megatron_glm5.data.jsonl import iter_jsonl
        from megatron_glm5.data.sft import validate_chat_record

        def validate(record):
            if "messages" in record:
                validate_chat_record({**record, "messages": record["messages"] + [{"role": "assistant",
                                                                                     "content": "x"}]})
            elif not isinstance(record.get("prompt"), str):
                raise ValueError("needs a 'prompt' string or a 'messages' list")

        for line_no, record in iter_jsonl(args.prompts_file, validate=validate):
            where = f"{args.prompts_file}:{line_no}"
            if "messages" in record:
                ids = tok.apply_chat_template(record["messages"], tools=record.get("tools"),
                                              add_generation_prompt=True)
                prompts.append((record["messages"][-1].get("content", ""), ids))
            else:
                prompts.append((record["prompt"], _encode(tok, record["prompt"], args.chat, where)))
    return prompts


def _run_eval(args, model, tok, stage=None) -> int:
    from megatron_glm5.generation.perplexity import perplexity

    t0 = time.time()
    result = perplexity(model, tok, args.eval, stage=stage)
    result["seconds"] = round(time.time() - t0, 3)
    if stage is not None and not stage.is_lead:
        return 0
    print(f"eval {args.eval}: {result['records']} records, {result['tokens']} predicted tokens, mean NLL "
          f"{result['nll']:.6f}, ppl {result['ppl']:.4f}")
    print("eval " + json.dumps(result, sort_keys=True))
    return 0


def _run_generate(args, model, tok, stage=None) -> int:
    import torch

    from megatron_glm5.generation.decode import check_prompts, generate, model_device, model_max_positions
    from megatron_glm5.generation.sampling import Sampler, SamplingParams, stop_token_ids

    params = SamplingParams(greedy=args.greedy, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            seed=args.seed)
    prompts = read_prompts(args, tok)
    check_prompts([ids for _, ids in prompts], model_max_positions(model))  # numbered over all prompts
    lead = stage is None or stage.is_lead  # the rank that samples and prints
    sampler = Sampler(params, device=model_device(model)) if lead else None
    stops = stop_token_ids(model.glm5_config.eos_token_id, tok)
    dumped = [] if args.dump_logits and lead else None
    on_logits = None if dumped is None else (lambda logits: dumped.append(logits.detach().float().cpu()))
    t0, n_tokens = time.time(), 0
    for start in range(0, len(prompts), args.batch_size):
        chunk = prompts[start:start + args.batch_size]
        results = generate(model, [ids for _, ids in chunk], args.max_new_tokens, params, stops, sampler=sampler,
                           stage=stage, on_logits=on_logits)
        if not lead:
            continue
        for k, ((label, ids), res) in enumerate(zip(chunk, results)):
            n_tokens += len(res.tokens)
            body = res.tokens[:-1] if res.finish_reason == "stop" else res.tokens
            text = tok.decode(body)
            if args.json:
                print(json.dumps({"index": start + k + 1, "prompt": label, "prompt_tokens": len(ids),
                                  "completion": text, "tokens": res.tokens, "finish_reason": res.finish_reason},
                                 ensure_ascii=False), flush=True)
            else:
                print(f"--- {start + k + 1} ({len(ids)} prompt tokens, {len(res.tokens)} generated, "
                      f"{res.finish_reason})\n{text}", flush=True)
    if not lead:
        return 0
    if dumped is not None:
        torch.save(dumped, args.dump_logits)
    seconds = time.time() - t0
    print(f"generated {n_tokens} tokens for {len(prompts)} prompt(s) in {seconds:.2f} s "
          f"({n_tokens / max(seconds, 1e-9):.1f} tokens/s); sampling seed {sampler.seed}"
          f"{' (greedy)' if params.is_greedy else ''}", file=sys.stderr)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    _check_args(args)
    model, stage = _load(args)
    tok = _tokenizer(args, model)
    from megatron_glm5 import platform

    code = _run_eval(args, model, tok, stage) if args.eval is not None else _run_generate(args, model, tok, stage)
    platform.end_of_job()  # the ranks of a parallel decode exit cleanly (platform.end_of_job)
    return code
