#!/usr/bin/env python
"""Tokenize a jsonl corpus into a Megatron indexed dataset (PREFIX.bin + PREFIX.idx) for pretraining.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer /path/to/GLM-5 --workers 16 --append-eod

One document per line, its text under --json-key (default "text").  Output is written under temporary names and
renamed when complete: an interrupted run leaves no PREFIX.bin/.idx, and a complete prefix is skipped on a re-run
unless --overwrite.  Bad lines stop the run with "file:line: what is wrong" unless --skip-bad-lines; a line longer
than --max-sample-bytes is a bad line, refused before it is decoded.  Progress: a bar on a terminal, else a line
every --progress-interval seconds.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_glm5.sample_limits import MAX_SAMPLE_BYTES  # noqa: E402  (standard library only)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--input", required=True, help="input .jsonl file, one document per line")
    p.add_argument("--json-key", default="text", help="field holding the document text")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--tokenizer", default="tiny",
                   help="HF tokenizer directory, sentencepiece .model file, or 'tiny' (the shipped test tokenizer)")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    p.add_argument("--append-eod", action="store_true", help="end every document with the eod token")
    p.add_argument("--skip-bad-lines", action="store_true", help="count and skip malformed lines instead of failing")
    p.add_argument("--overwrite", action="store_true", help="rebuild PREFIX even if PREFIX.bin/.idx exist")
    p.add_argument("--max-sample-bytes", type=_positive_int, default=MAX_SAMPLE_BYTES,
                   help="a line longer than this many bytes is a bad line, refused before it is decoded (8 MiB)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    p.add_argument("--progress-interval", type=float, default=5.0, metavar="SECONDS",
                   help="seconds between progress lines when the output is not a terminal")
    return p


def _positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return n


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("megatron_glm5").setLevel(logging.INFO)
    if args.workers < 1:
        print("error: --workers must be >= 1", file=sys.stderr)
        return 2
    from megatron_glm5.data.preprocess import preprocess_jsonl
    from megatron_glm5.errors import UserError

    try:
        r = preprocess_jsonl(args.input, args.output_prefix, tokenizer=args.tokenizer, json_key=args.json_key,
                             workers=args.workers, append_eod=args.append_eod, skip_bad=args.skip_bad_lines,
                             overwrite=args.overwrite, progress=False if args.no_progress else None,
                             progress_interval=args.progress_interval, max_sample_bytes=args.max_sample_bytes)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if r.skipped_existing:
        print(f"{r.prefix}.bin/.idx already exist: skipped (use --overwrite to rebuild)")
    else:
        print(f"{r.prefix}.bin/.idx: {r.documents} documents, {r.tokens} tokens ({r.dtype}); "
              f"{r.skipped_bad} bad lines skipped, {r.empty} empty; {r.seconds:.1f}s")
    return 0


if __name__ == "__main__":
    from megatron_glm5.quiet import install_for_tool
    install_for_tool()  # third-party warnings that tell the user nothing (megatron_glm5/quiet.py)
    sys.exit(main())
