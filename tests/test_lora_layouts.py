"""LoRA at TP2 (sequence parallel), PP2 and EP2 (gloo, 2 processes) equals the single-process LoRA run.

The base is the --seed's model (model/init.py draws it from each tensor's global identity, the same at every
layout), the adapters' A too (lora/apply.py) and B starts at zero; 4 steps at --lr 1e-3 so that steps 2-4 run
through non-zero adapters on every path: column-parallel (A replicated, B sharded; the absorbed MLA's local_linear
and kv_b's dense_weight), row-parallel (A sharded, B replicated; reduce-scatter with sequence parallelism) and the
grouped expert LoRA sharded by EP. LM loss within 1e-6 and gradient norm (adapters only) within 5e-6 relative.
"""
from __future__ import annotations

import pytest

from layouts_harness import _assert_steps_match, _train

LORA = ["--lora-rank", "4", "--lr", "1e-3", "--train-iters", "4", "--no-save"]
LAYOUTS = {"tp2-sp": ["--tp", "2", "--sequence-parallel"], "pp2": ["--pp", "2"], "ep2": ["--ep", "2"]}


@pytest.mark.distributed
def test_lora_layouts_match_single_process(tmp_path):
    ref = _train(1, tmp_path / "ref", *LORA)
    for name, flags in LAYOUTS.items():
        _assert_steps_match(_train(2, tmp_path / name, *LORA, *flags), ref, range(1, 5), f"LoRA {name}")
