#!/usr/bin/env bash
# One GPU, real GLM-5.3 width (hidden 6144, 64 heads, MLA 2048/512, DSA 32x128 top-2048), 4 layers (3 dense + 1 MoE
# with 32 experts instead of 256; no MTP) so that the bf16 weights, fp32 gradients, fp32 master weights and
# Adam states (18 bytes per parameter) fit one 141 GB H200; bf16, 4K sequences.
# Pretrains on the shipped tiny text (tokenized with the tiny tokenizer: the point is speed and memory, not loss).
set -euo pipefail
cd "$(dirname "$0")/.."
"${PYTHON:-python3}" pretrain_glm5.py --hf-config examples/proxy/config.json --bf16 --seq-length 4096 \
  --micro-batch-size 1 --global-batch-size 1 --train-iters "${ITERS:-20}" --lr 1e-4 --min-lr 1e-5 \
  --lr-warmup-iters 2 --log-interval "${LOG_INTERVAL:-5}" --eval-interval 100000 --no-save \
  --tensorboard-dir "${TB_DIR:-runs/proxy/tensorboard}" --attn torch --no-mtp "$@"
