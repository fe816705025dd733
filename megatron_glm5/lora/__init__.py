"""LoRA fine-tuning of GLM-5 on a frozen base (bf16, or the frozen FP8 base of megatron_glm5/fp8/).

  targets.py     the user-facing target names (--lora-target-modules) -> the modules they adapt
  config.py      LoRAConfig: rank, alpha, dropout, targets, --train-indexer (what a LoRA checkpoint records)
  adapters.py    LoRA on megatron-core's ColumnParallelLinear / RowParallelLinear (tensor and sequence parallel)
  grouped.py     the grouped LoRA of the routed experts (per-expert A, B applied as grouped GEMMs)
  apply.py       wrap a built model chunk, freeze everything else
  flags.py       the --lora-* flags and their checks
  checkpoint.py  adapter-only checkpoints that name their base

docs/lora.md is the guide.
"""
