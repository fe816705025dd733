#!/usr/bin/env bash
# The tiny model under gloo on one CPU machine: tensor, pipeline and expert parallelism over 2 processes.
set -euo pipefail
cd "$(dirname "$0")/.."
for layout in "--tp 2" "--pp 2" "--ep 2"; do
  torchrun --nproc-per-node 2 finetune_glm5.py $layout --train-iters 20 --log-interval 5 \
    --save "runs/layout_${layout// /}" "$@"
done
