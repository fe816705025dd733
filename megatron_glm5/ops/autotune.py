"""``--attn auto`` by measurement: rank the available attention backends by a short benchmark on this GPU.

The benchmark is one DSA attention step at the run's shape class -- lightning-indexer top-k, sparse MLA forward and
backward, the sparse-stage indexer KL (forward, its gradients) -- on fresh random inputs, ``REPS`` timed repetitions
after one warm-up, CUDA events, median.  It runs once per (GPU name, backend package versions, shape bucket) and the
result is kept in a JSON file: ``$MEGATRON_GLM5_CACHE/attn_auto.json`` (default ``~/.cache/megatron_glm5/``), written
atomically (temporary file + rename).  A cache that cannot be read or parsed is ignored with one warning and
rewritten.  The choice and its timings are logged in one line.

No benchmark runs on a machine without CUDA or when at most one backend is available; then, and when the
benchmark fails for every backend, the fixed order (``registry.AUTO_PREFERENCE``) decides.  A backend whose
benchmark raises is ranked after every measured one.  Backends within ``TIE_MARGIN`` of the fastest keep the fixed
order among themselves, so that measurement noise does not make ranks of one job pick different backends.

``rank(candidates, shape, measure=..., cache_path=..., env=...)`` is the whole decision; ``measure`` (a function
``(backend, shape) -> ms``) is the CUDA-event benchmark by default, a fake timer in the tests.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import statistics
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["AttnShape", "CACHE_ENV", "TIE_MARGIN", "cache_file", "cache_key", "measure_cuda", "rank",
           "shape_from_config"]

logger = logging.getLogger("megatron_glm5.ops")

CACHE_ENV = "MEGATRON_GLM5_CACHE"
CACHE_NAME = "attn_auto.json"
#: a backend must be this much faster than an earlier one of the fixed order to be ranked before it
TIE_MARGIN = 0.03
#: timed repetitions (after one warm-up) and the benchmark's token count cap
REPS = 3
BENCH_TOKENS = 4096
#: packages whose versions are part of the cache key (a new kernel library version is measured again)
VERSIONED_PACKAGES = ("torch", "triton", "tilelang", "flash_mla", "flash-mla", "nvidia-cudnn-frontend",
                      "nvidia-cudnn-cu12", "megatron-glm5")


@dataclasses.dataclass(frozen=True)
class AttnShape:
    """The shape class the benchmark runs at: local heads, q/k width, value width, top-k, indexer heads and head
    dim, benchmark tokens (the sequence bucket), dtype name."""

    heads: int
    d_qk: int
    d_v: int
    topk: int
    index_heads: int
    index_dim: int
    tokens: int = BENCH_TOKENS
    dtype: str = "bfloat16"

    def bucket(self) -> str:
        return (f"h{self.heads}-dqk{self.d_qk}-dv{self.d_v}-k{self.topk}-ih{self.index_heads}-id{self.index_dim}"
                f"-t{self.tokens}-{self.dtype}")


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def shape_from_config(config, seq_length: Optional[int] = None) -> AttnShape:
    """The shape class of a GLM5TransformerConfig's attention on one tensor-parallel rank; the token count is the
    sequence bucket (the next power of two of seq_length, at most BENCH_TOKENS; BENCH_TOKENS when unknown)."""
    tp = max(1, int(getattr(config, "tensor_model_parallel_size", 1) or 1))
    heads = max(1, config.num_attention_heads // tp)
    d_v = config.kv_lora_rank
    tokens = BENCH_TOKENS if not seq_length else min(BENCH_TOKENS, _pow2_at_least(seq_length))
    dtype = str(getattr(config, "params_dtype", torch.bfloat16)).replace("torch.", "")
    return AttnShape(heads=heads, d_qk=d_v + config.qk_pos_emb_head_dim, d_v=d_v,
                     topk=min(config.dsa_index_topk, tokens), index_heads=config.dsa_index_n_heads,
                     index_dim=config.dsa_index_head_dim, tokens=tokens, dtype=dtype)


def _versions() -> str:
    found = []
    for pkg in VERSIONED_PACKAGES:
        try:
            found.append(f"{pkg}={metadata.version(pkg)}")
        except metadata.PackageNotFoundError:
            continue
    return ",".join(found)


def gpu_name() -> str:
    return torch.cuda.get_device_name(torch.cuda.current_device())


def cache_key(shape: AttnShape, gpu: Optional[str] = None, versions: Optional[str] = None) -> str:
    gpu = gpu_name() if gpu is None else gpu
    versions = _versions() if versions is None else versions
    return f"{gpu}|{versions}|{shape.bucket()}"


def cache_file(env: Optional[Dict[str, str]] = None) -> Path:
    env = os.environ if env is None else env
    root = env.get(CACHE_ENV) or str(Path.home() / ".cache" / "megatron_glm5")
    return Path(root) / CACHE_NAME


_warned_corrupt = set()


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return data
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        if str(path) not in _warned_corrupt:
            _warned_corrupt.add(str(path))
            logger.warning("--attn auto: ignoring the unreadable benchmark cache %s (%s); it will be rewritten",
                           path, e)
        return {}


def _write_cache(path: Path, data: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:  # a read-only home: the choice still stands, it is measured again next time
        logger.warning("--attn auto: could not write the benchmark cache %s (%s)", path, e)


def _order(names: Sequence[str], ms: Dict[str, Optional[float]]) -> List[str]:
    """names (in the fixed order) ranked by ms: each next pick is the fastest remaining, unless an earlier one of
    the fixed order is within TIE_MARGIN of it; unmeasured (None / not finite) last, in the fixed order."""
    measured = [n for n in names if ms.get(n) is not None and math.isfinite(ms[n])]
    rest = [n for n in names if n not in measured]
    ranked = []
    while measured:
        best = min(ms[n] for n in measured)
        pick = next(n for n in measured if ms[n] <= best * (1 + TIE_MARGIN))
        ranked.append(pick)
        measured.remove(pick)
    return ranked + rest


def rank(candidates: Sequence, shape: AttnShape, measure: Optional[Callable] = None,
         cache_path: Optional[Path] = None, gpu: Optional[str] = None, versions: Optional[str] = None,
         cuda: Optional[bool] = None) -> Tuple[list, Optional[Dict[str, Optional[float]]]]:
    """(candidates ranked fastest first, their times in ms or None when nothing was measured).

    candidates: the implemented, available backends in the fixed order.  With CUDA and at least two of them the
    cached timings for (gpu, versions, shape) are used, else each is measured (``measure(backend, shape) -> ms``)
    and the cache updated."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    candidates = list(candidates)
    if not cuda or len(candidates) <= 1:
        return candidates, None
    measure = measure_cuda if measure is None else measure
    names = [b.name for b in candidates]
    path = cache_file() if cache_path is None else Path(cache_path)
    key = cache_key(shape, gpu=gpu, versions=versions)
    data = _read_cache(path)
    entry = data.get(key)
    ms = entry.get("ms") if isinstance(entry, dict) else None
    cached = isinstance(ms, dict) and all(n in ms for n in names)
    if not cached:
        ms = dict(ms) if isinstance(ms, dict) else {}
        for b in candidates:
            if b.name in ms:
                continue
            try:
                ms[b.name] = float(measure(b, shape))
            except Exception as e:  # a backend that cannot run this shape is ranked last, with the reason logged
                logger.warning("--attn auto: benchmark of %s failed (%s: %s)", b.name, type(e).__name__,
                               str(e).splitlines()[0] if str(e) else "")
                ms[b.name] = None
        data = _read_cache(path)  # another process may have added keys meanwhile
        data[key] = {"ms": ms}
        _write_cache(path, data)
    by_name = dict(zip(names, candidates))
    order = _order(names, ms)
    if all(ms.get(n) is None for n in names):
        order = names  # the benchmark could not run at all: the fixed order
    timings = ", ".join(f"{n} {ms[n]:.2f} ms" if ms.get(n) is not None else f"{n} failed" for n in order)
    logger.info("--attn auto: %s (measured on %s, %s, %s: %s)", order[0], gpu or gpu_name(), shape.bucket(),
                "cached" if cached else f"benchmarked, cache {path}", timings)
    return [by_name[n] for n in order], {n: ms.get(n) for n in names}


def measure_cuda(backend, shape: AttnShape, reps: int = REPS) -> float:
    """Median ms (CUDA events) of one DSA attention step of ``backend`` at ``shape`` on the current GPU: indexer
    top-k, sparse MLA forward + backward, indexer KL with its gradients; fresh random inputs each repetition."""
    dev = torch.device("cuda", torch.cuda.current_device())
    dtype = getattr(torch, shape.dtype)
    t, h = shape.tokens, shape.heads
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(*size, dt=dtype, grad=False):
        x = torch.randn(*size, device=dev, dtype=torch.float32, generator=gen).to(dt)
        return x.requires_grad_(grad)

    key_start = torch.zeros(t, device=dev, dtype=torch.int64)
    query_end = torch.arange(t, device=dev, dtype=torch.int64)
    scale, iscale = shape.d_qk ** -0.5, shape.index_dim ** -0.5
    times = []
    for i in range(reps + 1):
        q, kv = rnd(t, h, shape.d_qk, grad=True), rnd(t, shape.d_qk, grad=True)
        qi, ki = rnd(t, shape.index_heads, shape.index_dim, grad=True), rnd(t, shape.index_dim, grad=True)
        w = rnd(t, shape.index_heads, dt=torch.float32, grad=True)
        d_out = rnd(t, h, shape.d_v)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        idx = backend.indexer_topk(qi.detach(), ki.detach(), w.detach(), shape.topk, key_start, query_end, iscale)
        out, lse = backend.sparse_mla(q, kv, idx, scale, shape.d_v, key_start=key_start, query_end=query_end)
        kl, _ = backend.indexer_kl_loss(qi, ki, w, iscale, q.detach(), kv.detach(), scale, key_start, query_end,
                                        indices=idx, attn_lse=lse.detach())
        torch.autograd.backward([out, kl], [d_out, torch.ones_like(kl)])
        end.record()
        torch.cuda.synchronize(dev)
        if i:  # the first run compiles / autotunes the kernels
            times.append(start.elapsed_time(end))
    return statistics.median(times)
