#!/usr/bin/env bash
# Tiny GLM-5 SFT on the shipped chat data, CPU, one process (the embedded default, spelled out).
set -euo pipefail
cd "$(dirname "$0")/.."
python finetune_glm5.py --config examples/recipes/tiny_cpu_sft.yaml "$@"
