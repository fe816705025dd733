#!/usr/bin/env python
"""Compare an HF directory with a torch_dist checkpoint: all tensors, and logits. See docs/conversion.md.

    python tools/verify_conversion.py --help
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_glm5.conversion.cli import verify_main  # noqa: E402

if __name__ == "__main__":
    from megatron_glm5.quiet import install_for_tool
    install_for_tool()  # third-party warnings that tell the user nothing (megatron_glm5/quiet.py)
    sys.exit(verify_main())
