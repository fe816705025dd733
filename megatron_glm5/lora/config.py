"""LoRAConfig: what a LoRA run adapts and how (the --lora-* flags, recorded in every adapter checkpoint)."""
from __future__ import annotations

import dataclasses
from typing import Tuple


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    rank: int
    alpha: float
    dropout: float
    targets: Tuple[str, ...]  # canonical target names (targets.TARGETS), sorted
    train_indexer: bool = False  # --train-indexer: the DSA indexers train fully, with their KL loss

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def to_record(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout, "targets": list(self.targets),
                "train_indexer": self.train_indexer}

    @classmethod
    def from_record(cls, record: dict) -> "LoRAConfig":
        return cls(rank=int(record["rank"]), alpha=float(record["alpha"]), dropout=float(record["dropout"]),
                   targets=tuple(record["targets"]), train_indexer=bool(record.get("train_indexer", False)))

    def trainable_name(self) -> str:
        """The checkpoint record's ``trainable`` value: which parameters the optimizer state covers."""
        return "lora+indexer" if self.train_indexer else "lora"
