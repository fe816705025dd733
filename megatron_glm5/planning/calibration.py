"""Measured per-layer times and memory (benchmarks/calibrate_layers.py writes them; the planner reads them).

A table is ``calibration_<gpu>.json`` beside this module: ``{"date", "device", "command", "rows": [...]}``, one row
per measured configuration: ``layer`` ("dense" or "moe"), ``tokens`` (per micro-batch on the rank),
``local_experts``, ``recompute`` (full recompute of the layer or not), ``fwd_bwd_ms`` (median forward + backward,
recompute included), ``peak_mib`` (the layer's peak allocation above its weights and input) and the shape fields
(``hidden``, ``seq_length``); ``optimizer`` (optional) lists optimizer steps timed by ``planning/measure.py
--time-optimizer-steps``.  A planner figure taken from a row says so; without a matching row the figure is a
datasheet estimate (step_time.py) and says that.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

_DIR = os.path.dirname(os.path.abspath(__file__))


def table_path(gpu_name: str) -> str:
    return os.path.join(_DIR, f"calibration_{gpu_name.split('-')[0]}.json")


@dataclass
class Calibration:
    path: str
    date: str
    device: str
    command: str
    rows: List[dict]
    optimizer: List[dict]  # {"elements", "step_ms", "command"}: megatron-core optimizer steps timed by measure.py

    def optimizer_s_per_element(self) -> Optional[float]:
        """Seconds per owned element of a measured optimizer step (the largest measured), or None."""
        if not self.optimizer:
            return None
        big = max(self.optimizer, key=lambda o: o["elements"])
        return big["step_ms"] / 1e3 / big["elements"]

    def layer_ms(self, layer: str, tokens: float, local_experts: int, recompute: bool,
                 hidden: int) -> Optional[Tuple[float, str]]:
        """(measured forward+backward ms of one layer at ``tokens``, what was used), log-log interpolated between
        the two nearest measured token counts of the same (layer, recompute, width) and, for a MoE layer, the
        measured local-expert count nearest to ``local_experts`` (named in the note when it differs); None
        outside the measured token range or without such rows."""
        rows = [r for r in self.rows if r["layer"] == layer and r["recompute"] == recompute
                and r.get("hidden") == hidden]
        note = ""
        if layer == "moe" and rows:
            counts = sorted({r["local_experts"] for r in rows})
            near = min(counts, key=lambda n: abs(math.log(n / local_experts)))
            rows = [r for r in rows if r["local_experts"] == near]
            if near != local_experts:
                note = f"MoE layers at {local_experts} local experts timed as {near}"
        pts = sorted((r["tokens"], r["fwd_bwd_ms"]) for r in rows)
        if not pts or not pts[0][0] <= tokens <= pts[-1][0]:
            return None
        for (t0, m0), (t1, m1) in zip(pts, pts[1:]):
            if t0 <= tokens <= t1 and t1 > t0:
                w = (math.log(tokens) - math.log(t0)) / (math.log(t1) - math.log(t0))
                return math.exp(math.log(m0) + w * (math.log(m1) - math.log(m0))), note
        return pts[0][1], note


def load(gpu_name: str) -> Optional[Calibration]:
    """The table for this GPU family, or None when none was measured."""
    path = table_path(gpu_name)
    if not os.path.isfile(path):
        return None
    with open(path, "r", encoding="utf-8") as f:
        d = json.load(f)
    return Calibration(path=path, date=d["date"], device=d["device"], command=d["command"], rows=d["rows"],
                       optimizer=d.get("optimizer", []))
