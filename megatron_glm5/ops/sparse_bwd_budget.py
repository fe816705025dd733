"""What our sparse-MLA backward holds in memory while it runs, from host-known sizes.

The one place for the backward's buffer budgets, its dk-formulation rule and its chunk arithmetic: read by the
backward itself (``ops/triton_sparse_mla.py``, whose ``DensePlan`` the tilelang backend's dense backward fills too)
and by the memory planner (``planning/memory.py``), which imports no GPU library -- so nothing here does either.
"""
from __future__ import annotations

import os
from typing import Optional

# bytes of fp32 per-(query, slot) dkv contributions held at once in deterministic mode ("slots", "in_kernel")
DET_BUFFER_BYTES = 2 << 30
# bytes of the p / ds chunk buffers of the "slots" and "dense" backward
PDS_BUFFER_BYTES = 1 << 30
# "auto" picks "dense" while n_keys / topk (host-known: the keys "dense" may multiply per query against the slots
# "slots" adds) is at most this, per dkv mode.  benchmarks/dsa_kernels.py (docs/performance.md, sessions 10 and 15),
# causal, where the keys really multiplied are about half of n_keys: "dense" is faster in both modes at S 4096-16384
# (n_keys / topk 2-8; H100, session 15, atomic at 16384: our TileLang scores + cuBLAS 60.3 ms against the Triton
# "slots" backward's 72.7, Triton's own dense 68.2 against 70.3); at S 24576 (12) and 32768 (16) "slots" is faster
# atomic (121.2 against 128.3 ms; 173.3 against 210.7, the dense formulation timed in deterministic mode -- the same
# computation in both) and "dense" deterministic (no sort, no segmented sums)
DENSE_KEY_RATIO = {"atomic": 8.0, "deterministic": 20.0}
# BWD_CONFIG DENSE_PREFIX (our TileLang backward): past the rows whose host-known last key is below this x topk the
# dense formulation costs more per row than "slots" (a per-row fit of the H100's session-15 figures: about
# 0.92 us + 0.34 ns x key end per row dense, 5.1 us atomic / 7.7 us deterministic "slots"), so a backward may take
# it for those leading rows only (causal: the first ones) and "slots" for the rest; at least MIN_PREFIX_ROWS rows.
# Measured (H100, session 16, with head sums): atomic 164.8 against 173.8 ms at S 32768 and 111.7 against 122.0 at
# 24576 (where "auto" takes "slots"), 58.4 against 57.6 at 16384 (where it takes "dense"); deterministic 197.2
# against 203.0 at 32768, 123.9 against 121.8 at 24576 -- hence the default "atomic" (prefix_applies)
PREFIX_KEY_RATIO = {"atomic": 6.0, "deterministic": 10.0}
MIN_PREFIX_ROWS = 256
DENSE_PREFIX_DEFAULT = "atomic"  # BWD_CONFIG's DENSE_PREFIX, which the memory planner counts (kept_buffer_bytes)
# BWD_CONFIG ZEROS "auto": the dense plan keeps its buffer zero between backwards ("restore") where n_keys / topk
# exceeds this (the selected entries a small part of the matrices), else it zeroes each chunk's ("memset")
ZEROS_RESTORE_RATIO = 2.0


def deterministic_default() -> bool:
    """GLM5_TRITON_DETERMINISTIC (1 / 0; default 0): the default dkv mode of our sparse backward and indexer KL."""
    v = os.environ.get("GLM5_TRITON_DETERMINISTIC", "0").strip().lower()
    if v not in ("0", "1", "true", "false", "yes", "no", ""):
        raise ValueError(f"GLM5_TRITON_DETERMINISTIC must be 0 or 1, got {v!r}")
    return v in ("1", "true", "yes")


def chunk_rows(n_q: int, per_row_bytes: int, budget: int) -> int:
    """Query rows per launch so that the per-row buffers of a chunk stay within ``budget`` bytes."""
    return max(1, min(n_q, budget // max(1, per_row_bytes)))


def dense_rows(n_q: int, n_keys: int, h: int, elt: int, budget: int, cap: Optional[int] = None) -> int:
    """Query rows per chunk of the "dense" formulation: its [key, rows x heads] dS and P matrices within ``budget``,
    and at most ``cap`` rows (BWD_CONFIG's DENSE_ROWS; smaller chunks multiply fewer keys above the causal
    diagonal)."""
    rows = chunk_rows(n_q, 2 * n_keys * h * elt, budget)
    return min(rows, int(cap)) if cap else rows


def auto_dk_mode(n_keys: int, topk: int, deterministic: bool) -> str:
    """DK "auto": "dense" when the keys it may multiply per query (all n_keys: the causal structure is not known on
    the host) are at most DENSE_KEY_RATIO x the top-k slots per query that "slots" adds into dkv, else "slots"."""
    ratio = n_keys / max(1, min(topk, n_keys))
    return "dense" if ratio <= DENSE_KEY_RATIO["deterministic" if deterministic else "atomic"] else "slots"


def dense_prefix_rows(row_hi, topk: int, deterministic: bool) -> int:
    """How many leading rows of a top-k list whose rows' last keys are ``row_hi`` (host int64 [T], -1: no keys)
    have them below PREFIX_KEY_RATIO x topk: the rows the dense formulation takes with DENSE_PREFIX."""
    limit = PREFIX_KEY_RATIO["deterministic" if deterministic else "atomic"] * max(1, topk)
    over = (row_hi.reshape(-1) >= limit).nonzero()
    return int(over[0, 0]) if over.numel() else int(row_hi.numel())


def prefix_applies(setting, n_keys: int, topk: int, deterministic: bool) -> bool:
    """Whether BWD_CONFIG's DENSE_PREFIX ``setting`` lets a backward split off a dense prefix (given enough rows
    below the limit): False -- never; "atomic" (the default) -- in atomic mode where DK "auto" takes "slots" for
    the whole (more than DENSE_KEY_RATIO keys per slot: the only place it measured faster); True -- both modes,
    at any length."""
    if setting is True:
        return True
    if setting is False or setting is None:
        return False
    if setting != "atomic":
        raise ValueError(f"BWD_CONFIG DENSE_PREFIX must be False, 'atomic' or True, got {setting!r}")
    return not deterministic and auto_dk_mode(n_keys, topk, False) == "slots"


def dense_prefix_buffer_bytes(n_q: int, n_keys: int, heads: int, topk: int, elt: int = 2) -> int:
    """The most a DENSE_PREFIX backward's dense part keeps in its zeroed P / dS buffer on causal lists: chunks sized
    for all n_keys (dense_rows) over at most min(n_q, limit) prefix rows, their key ends below the limit
    (PREFIX_KEY_RATIO["atomic"] x topk) -- an upper bound for every rank (with CP, a rank whose first chunk of rows
    lies below the limit takes that chunk as its prefix)."""
    limit = int(PREFIX_KEY_RATIO["atomic"] * max(1, topk))
    return _dense_buffer_bytes(min(n_q, limit), n_keys, min(n_keys, limit), heads, elt)


def _dense_buffer_bytes(n_q: int, n_keys: int, key_end: int, heads: int, elt: int) -> int:
    """One chunk buffer of the dense formulation: the [key_end, rows x heads] dS and P matrices, rows sized for
    n_keys (dense_rows, as DensePlan sizes them)."""
    return 2 * key_end * dense_rows(n_q, n_keys, heads, elt, PDS_BUFFER_BYTES) * heads * elt


def auto_restores(n_keys: int, topk: int) -> bool:
    """ZEROS "auto" on a device where the restore kernel runs: keep the buffer zero ("restore")?"""
    return n_keys > ZEROS_RESTORE_RATIO * topk


def backward_buffer_bytes(n_q: int, n_keys: int, heads: int, topk: int, d_qk: int = 576, elt: int = 2,
                          deterministic: Optional[bool] = None, dense_prefix: bool = False) -> int:
    """The most the default backward (DK, ZEROS "auto", ZERO_AHEAD on, the indexer's host row bounds known) holds in
    its P / dS and per-slot buffers for ``n_q`` queries of this rank against ``n_keys`` keys with ``heads`` heads
    here, d_qk wide, inputs of ``elt`` bytes: "dense" -- one chunk buffer of 2 x n_keys x rows x heads (the last
    chunk's key end is at most n_keys) kept between backwards ("restore"), or two while a backward of two chunks or
    more runs (the next one zeroed ahead); "slots" -- the [rows, 2, topk, heads padded to 16 / a power of two] buffer, plus in
    deterministic mode the fp32 per-slot rows (DET_BUFFER_BYTES at most).  ``dense_prefix``: the backward is our
    TileLang one with BWD_CONFIG's default DENSE_PREFIX, whose dense part (where it applies) keeps its buffer too
    (kept_buffer_bytes)."""
    det = deterministic_default() if deterministic is None else bool(deterministic)
    if n_q <= 0 or n_keys <= 0 or topk <= 0:
        return 0
    if auto_dk_mode(n_keys, topk, det) == "dense":
        rows = dense_rows(n_q, n_keys, heads, elt, PDS_BUFFER_BYTES)
        two_ahead = not auto_restores(n_keys, topk) and -(-n_q // rows) > 1
        return _dense_buffer_bytes(n_q, n_keys, n_keys, heads, elt) * (2 if two_ahead else 1)
    hp = max(16, 1 << max(0, heads - 1).bit_length())
    per_row = 2 * topk * hp * elt
    rows = chunk_rows(n_q, per_row, PDS_BUFFER_BYTES)
    held = rows * per_row
    if det:
        det_row = topk * d_qk * 4  # fp32 dkv rows per (query, slot)
        held += chunk_rows(rows, det_row, DET_BUFFER_BYTES) * det_row
    return held + kept_buffer_bytes(n_q, n_keys, heads, topk, elt, det, dense_prefix)


def kept_buffer_bytes(n_q: int, n_keys: int, heads: int, topk: int, elt: int = 2,
                      deterministic: Optional[bool] = None, dense_prefix: bool = False) -> int:
    """Of backward_buffer_bytes, what stays allocated between backwards (through the optimizer step): the dense
    formulation's buffer under ZEROS "restore", or (``dense_prefix``) the dense prefix's."""
    det = deterministic_default() if deterministic is None else bool(deterministic)
    if n_q <= 0 or n_keys <= 0 or topk <= 0:
        return 0
    if auto_dk_mode(n_keys, topk, det) == "dense":
        return _dense_buffer_bytes(n_q, n_keys, n_keys, heads, elt) if auto_restores(n_keys, topk) else 0
    if dense_prefix and prefix_applies(DENSE_PREFIX_DEFAULT, n_keys, topk, det):
        return dense_prefix_buffer_bytes(n_q, n_keys, heads, topk, elt)
    return 0
