"""Reading HF safetensors checkpoints (one file or sharded with model.safetensors.index.json), lazily.

``HFCheckpointReader`` maps every tensor name to its shard and opens shards on demand, so callers hold one
tensor (or one group of tensors) at a time. Errors name the directory and the missing file or key.
"""
from __future__ import annotations

import json
import os
from typing import Iterable

import torch
from safetensors import safe_open

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint directory is missing files, keys or is not readable."""


class HFCheckpointReader:
    def __init__(self, directory: str):
        self.directory = os.fspath(directory)
        index_path = os.path.join(self.directory, INDEX_NAME)
        single_path = os.path.join(self.directory, SINGLE_NAME)
        if os.path.isfile(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index_path}: not a valid safetensors index ({e})") from None
            for shard in sorted(set(weight_map.values())):
                if not os.path.isfile(os.path.join(self.directory, shard)):
                    raise CheckpointError(f"{index_path} names shard {shard}, which is missing from {self.directory}")
            self.weight_map = dict(weight_map)
        elif os.path.isfile(single_path):
            self.weight_map = {k: SINGLE_NAME for k in self._open(SINGLE_NAME).keys()}
        else:
            raise CheckpointError(f"{self.directory}: no {SINGLE_NAME} or {INDEX_NAME} (is this an HF model directory?)")
        self._handles = {}

    def _open(self, shard: str):
        path = os.path.join(self.directory, shard)
        try:
            return safe_open(path, framework="pt")
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
            raise CheckpointError(f"{path}: cannot read safetensors file ({e})") from None

    def keys(self) -> Iterable[str]:
        return self.weight_map.keys()

    def __contains__(self, key: str) -> bool:
        return key in self.weight_map

    def get(self, key: str) -> torch.Tensor:
        if key not in self.weight_map:
            raise CheckpointError(f"{self.directory}: tensor {key} is not in the checkpoint")
        shard = self.weight_map[key]
        if shard not in self._handles:
            self._handles[shard] = self._open(shard)
        try:
            return self._handles[shard].get_tensor(key)
        except Exception as e:
            raise CheckpointError(f"{os.path.join(self.directory, shard)}: cannot read tensor {key} ({e})") from None
