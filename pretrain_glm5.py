"""Pretrain a GLM-5 model. `python pretrain_glm5.py` runs the embedded tiny CPU default; see --help and README."""
import sys

from megatron_glm5.training.entry import main

if __name__ == "__main__":
    sys.exit(main("pretrain"))
