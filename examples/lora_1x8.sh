#!/usr/bin/env bash
# GLM-5.3 LoRA on one node of 8 GPUs (docs/lora.md): convert the FP8 release keeping its FP8 tensors, train the
# adapters on the frozen FP8 base, export them for PEFT. Set HF_DIR (the GLM-5.3-FP8 HF directory), DATA (chat
# JSONL), WORK (a directory with about 800 GB free). Extra flags for finetune_glm5.py go after the script's name.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
: "${HF_DIR:?set HF_DIR to the GLM-5.3-FP8 HF directory}" "${DATA:?set DATA to the training JSONL}"
WORK=${WORK:-runs/lora_1x8}
BASE="$WORK/base-fp8"
[ -d "$BASE" ] || "$PYTHON" tools/convert_hf_to_megatron.py --hf-dir "$HF_DIR" --save "$BASE" --keep-fp8 --pp 8
"$PYTHON" -m torch.distributed.run --nproc-per-node 8 finetune_glm5.py \
  --config examples/recipes/glm5.3_lora_1x8.yaml --load "$BASE" --tokenizer "$HF_DIR" --data-path "$DATA" \
  --valid-data-path "${VALID:-$DATA}" --save "$WORK/run" "$@"
"$PYTHON" tools/convert_megatron_to_hf.py --load "$WORK/run" --save "$WORK/peft"  # adapter_config.json + safetensors
echo "PEFT adapters in $WORK/peft: PeftModel.from_pretrained(GlmMoeDsaForCausalLM.from_pretrained(\"$HF_DIR\"), \"$WORK/peft\")"
