#!/usr/bin/env bash
# The tiny model under gloo on one CPU machine: tensor, pipeline and expert parallelism over 2 processes.
# Each invocation writes a new folder runs/layouts/<time>/{tp2,pp2,ep2}; compare the curves with
#   python tools/compare_runs.py runs/layouts/<time>/tp2 runs/layouts/<time>/pp2 runs/layouts/<time>/ep2
set -euo pipefail
cd "$(dirname "$0")/.."
out="runs/layouts/$(date +%Y%m%d-%H%M%S)"
for layout in tp pp ep; do
  torchrun --nproc-per-node 2 finetune_glm5.py "--$layout" 2 --train-iters 20 --log-interval 5 \
    --save "$out/${layout}2" "$@"
done
echo "runs in $out"
