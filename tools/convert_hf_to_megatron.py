#!/usr/bin/env python
"""HF GLM-5 checkpoint -> megatron-core torch_dist checkpoint (streaming, any layout). See docs/conversion.md.

    python tools/convert_hf_to_megatron.py --help
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_glm5.conversion.cli import hf_to_megatron_main  # noqa: E402

if __name__ == "__main__":
    from megatron_glm5.quiet import install_for_tool
    install_for_tool()  # third-party warnings that tell the user nothing (megatron_glm5/quiet.py)
    sys.exit(hf_to_megatron_main())
