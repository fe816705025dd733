"""The GLM-5 model on megatron-core: specs, MLA, DSA, MoE, and the GPTModel subclass."""
