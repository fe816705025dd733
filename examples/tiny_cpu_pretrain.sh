#!/usr/bin/env bash
# Tiny GLM-5 pretraining on the shipped text, CPU: preprocess two corpora, then train on a 70/30 blend.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p runs/data
for name in pretrain_a pretrain_b; do
  python tools/preprocess_data.py --input "megatron_glm5/assets/data/$name.jsonl" \
    --output-prefix "runs/data/$name" --tokenizer tiny --append-eod --workers 2
done
python pretrain_glm5.py --config examples/recipes/tiny_cpu_pretrain.yaml \
  --data-path 0.7 runs/data/pretrain_a 0.3 runs/data/pretrain_b "$@"
