"""The directory under which the data caches live (the jsonl index cache, the SFT token cache):
``$XDG_CACHE_HOME/megatron_glm5`` (default ``~/.cache/megatron_glm5``)."""
from __future__ import annotations

import os

__all__ = ["cache_root"]


def cache_root() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "megatron_glm5")
