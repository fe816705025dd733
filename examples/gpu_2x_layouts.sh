#!/usr/bin/env bash
# Two GPUs of one host (nvidia-h200-x2): the same bf16 model and data at 1 GPU, TP2, EP2 and PP2 (each from the same
# initial checkpoint), 20 steps; loss curves land in runs/layouts/<layout>/tensorboard/metrics.jsonl.
# LR (default 1e-5, warm-up 5 steps) is small enough that random initialisation trains without loss spikes, so the
# curves can be compared step by step (at 1e-4 the loss spiked at step 3 and the layouts diverged).
# Model: GLM-5.3 width (hidden 6144, 64 heads, MLA, DSA top-2048), 2 layers (1 dense + 1 MoE with 16 experts), no MTP.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT_DIR:-runs/layouts}
COMMON=(--hf-config examples/proxy2/config.json --bf16 --seq-length 4096 --micro-batch-size 1 --global-batch-size 2
        --lr "${LR:-1e-5}" --min-lr 1e-6 --lr-warmup-iters 5 --log-interval 1 --eval-interval 100000 --attn torch --no-mtp
        --seed 7 --use-distributed-optimizer)
python pretrain_glm5.py "${COMMON[@]}" --train-iters 1 --lr 0 --min-lr 0 --lr-warmup-iters 0 --save "$OUT/init"
for layout in "1gpu:1:" "tp2:2:--tp 2" "ep2:2:--ep 2" "pp2:2:--pp 2"; do
  name=${layout%%:*}; rest=${layout#*:}; n=${rest%%:*}; flags=${rest#*:}
  torchrun --nproc-per-node "$n" pretrain_glm5.py "${COMMON[@]}" $flags --train-iters "${ITERS:-20}" \
    --load "$OUT/init" --finetune --no-save --tensorboard-dir "$OUT/$name/tensorboard"
done
