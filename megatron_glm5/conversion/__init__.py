"""HF <-> Megatron conversion: the name/shape table (hf_mapping) shared by the in-memory API and the tools."""
