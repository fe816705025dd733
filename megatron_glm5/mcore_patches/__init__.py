"""The patches of megatron-core, one record each (see registry.py). Importing the package imports nothing."""
