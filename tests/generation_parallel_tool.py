"""Run tools/generate.py's main several times in one torchrun launch (tests/test_generation_parallel.py): each
RUN is ``NAME=ARGS`` (ARGS one string, shell-split), its stdout written to OUT/NAME.rank<RANK>.out; the layout
flags common to every run come after ``--``.

    torchrun --nproc-per-node 2 tests/generation_parallel_tool.py OUT "greedy=--load CKPT ..." ... -- --tp 2
"""
import contextlib
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_glm5.arguments import main_guard  # noqa: E402
from megatron_glm5.generation.cli import main  # noqa: E402


def run() -> int:
    out, rest = sys.argv[1], sys.argv[2:]
    split = rest.index("--")
    runs, layout = rest[:split], rest[split + 1:]
    rank = os.environ.get("RANK", "0")
    for spec in runs:
        name, args = spec.split("=", 1)
        with open(os.path.join(out, f"{name}.rank{rank}.out"), "w") as f, contextlib.redirect_stdout(f):
            status = main(shlex.split(args) + layout)
        if status:
            return status
    return 0


if __name__ == "__main__":
    from megatron_glm5.quiet import install_for_tool
    install_for_tool()
    with main_guard():
        sys.exit(run())
