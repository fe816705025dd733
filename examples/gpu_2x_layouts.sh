#!/usr/bin/env bash
# Two GPUs of one host (nvidia-h200-x2): the same bf16 model and data at 1 GPU, TP2, EP2 and PP2 (each from the same
# initial checkpoint), 20 steps; loss curves land in $OUT/<layout>/tensorboard/metrics.jsonl.
# "1gpu-mb2" is the noise-floor control: the 1-GPU run with micro-batch 2 instead of 2 x 1 (the same mathematics,
# rounded differently by bf16), so layout differences can be compared with pure bf16 rounding differences.
# Model: MODEL="--hf-config examples/proxy2/config.json" (default: GLM-5.3 width, 2 layers = 1 dense + 1 MoE with
# 16 experts, no MTP) or e.g. MODEL="--preset tiny" SEQ=512. LR (default 1e-5, warm-up 5 steps) is small enough that
# random initialisation trains without loss spikes.  LAYOUTS: "name:gpus:flags" items, the flags comma-separated
# (e.g. "pp2vpp2:2:--pp=2,--vpp=2"); RUN_TIMEOUT=SECONDS bounds each run; compare with `python tools/compare_runs.py $OUT/1gpu $OUT/<layout> ...`.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT_DIR:-runs/layouts}
PYTHON=${PYTHON:-python3}  # the interpreter that has torch (a bare `python` may be another one)
read -r -a MODEL_ARGS <<< "${MODEL:---hf-config examples/proxy2/config.json}"
COMMON=("${MODEL_ARGS[@]}" --bf16 --seq-length "${SEQ:-4096}" --global-batch-size 2
        --lr "${LR:-1e-5}" --min-lr 1e-6 --lr-warmup-iters 5 --log-interval 1 --eval-interval 100000 --attn torch --no-mtp
        --seed 7 --use-distributed-optimizer)
"$PYTHON" pretrain_glm5.py "${COMMON[@]}" --micro-batch-size 1 --train-iters 1 --lr 0 --min-lr 0 --lr-warmup-iters 0 \
  --save "$OUT/init"
for layout in ${LAYOUTS:-"1gpu:1:" "1gpu-mb2:1:--micro-batch-size=2" "tp2:2:--tp=2" "ep2:2:--ep=2" "pp2:2:--pp=2"}; do
  name=${layout%%:*}; rest=${layout#*:}; n=${rest%%:*}; flags=${rest#*:}; flags=${flags//,/ }
  ${RUN_TIMEOUT:+timeout "$RUN_TIMEOUT"} "$PYTHON" -m torch.distributed.run --nproc-per-node "$n" pretrain_glm5.py "${COMMON[@]}" --micro-batch-size 1 $flags \
    --train-iters "${ITERS:-20}" --load "$OUT/init" --finetune --no-save --tensorboard-dir "$OUT/$name/tensorboard" \
    || echo "layout $name FAILED (exit $?); going on with the next" >&2
done
