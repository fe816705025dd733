#!/usr/bin/env python
"""Generate text from a megatron-glm5 checkpoint (--load or --hf-dir), or measure perplexity (--eval).
See docs/generation.md.

    python tools/generate.py --help
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_glm5.arguments import main_guard  # noqa: E402
from megatron_glm5.generation.cli import main  # noqa: E402

if __name__ == "__main__":
    from megatron_glm5.quiet import install_for_tool
    install_for_tool()  # third-party warnings that tell the user nothing (megatron_glm5/quiet.py)
    with main_guard():
        sys.exit(main())
