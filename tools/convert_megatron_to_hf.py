#!/usr/bin/env python
"""megatron-glm5 torch_dist checkpoint -> HF directory for transformers / vLLM (streaming). See docs/conversion.md.

    python tools/convert_megatron_to_hf.py --help
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_glm5.conversion.cli import megatron_to_hf_main  # noqa: E402

if __name__ == "__main__":
    from megatron_glm5.quiet import install_for_tool
    install_for_tool()  # third-party warnings that tell the user nothing (megatron_glm5/quiet.py)
    sys.exit(megatron_to_hf_main())
