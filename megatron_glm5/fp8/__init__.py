"""The frozen FP8 base: the block-scaled format (blocks.py), its matmuls (matmul.py), the frozen modules."""
