"""The checkpoint on disk: ``format`` (directory names, the latest pointer, the "glm5" record) and ``manifest``.

Shared by the trainer (training/checkpointing.py) and the converters (conversion/); imports neither."""
