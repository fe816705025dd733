"""Fine-tune a GLM-5 model (Megatron-style flags; `python finetune_glm5.py --help`)."""
import sys

if __name__ == "__main__":
    print("megatron-glm5: training arrives in a later issue; the model, its HF parity and the conversion table "
          "are in place (see README).", file=sys.stderr)
    sys.exit(1)
