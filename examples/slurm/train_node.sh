#!/usr/bin/env bash
# One node's share of a multi-node run: torchrun with one process per GPU. Called by glm5_sft.sbatch through srun
# (one task per node); any extra arguments go to the entry script.
#   ENTRY       finetune_glm5.py (default) or pretrain_glm5.py
#   MASTER_ADDR first node of the allocation; MASTER_PORT (29500)
set -euo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
export CUDA_DEVICE_MAX_CONNECTIONS=1
exec torchrun --nnodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID" --nproc-per-node "${GPUS_PER_NODE:-8}" \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" --rdzv-id "${SLURM_JOB_ID:-glm5}" \
  "${ENTRY:-finetune_glm5.py}" "$@"
