"""--attn auto by measurement (ops/autotune.py): ranking by the timings, the cache (read, write, key invalidation,
corrupt file), no benchmark on CPU or with one backend, the fixed order when the benchmark cannot run."""

import json
import logging

import pytest

from megatron_glm5.ops import autotune, registry

SHAPE = autotune.AttnShape(heads=64, d_qk=576, d_v=512, topk=2048, index_heads=32, index_dim=128)


class Fake:
    def __init__(self, name):
        self.name = name


class Timer:
    """A fake timer: ms per backend name (an exception instance is raised), records each call."""

    def __init__(self, ms):
        self.ms, self.calls = dict(ms), []

    def __call__(self, backend, shape):
        self.calls.append((backend.name, shape))
        v = self.ms[backend.name]
        if isinstance(v, Exception):
            raise v
        return v


def _rank(names, timer, path, **kw):
    kw = dict(dict(gpu="NVIDIA H200", versions="torch=2.11,triton=3.6", cuda=True), **kw)
    order, ms = autotune.rank([Fake(n) for n in names], SHAPE, measure=timer, cache_path=path, **kw)
    return [b.name for b in order], ms


def test_ranking_follows_timings_and_cache_is_reused(tmp_path, caplog):
    path = tmp_path / "attn_auto.json"
    timer = Timer({"cudnn": 9.0, "tilelang": 4.0, "triton": 6.0})
    with caplog.at_level(logging.INFO, logger="megatron_glm5.ops"):
        order, ms = _rank(["cudnn", "tilelang", "triton"], timer, path)
    assert order == ["tilelang", "triton", "cudnn"]
    assert ms == {"cudnn": 9.0, "tilelang": 4.0, "triton": 6.0}
    assert [c[0] for c in timer.calls] == ["cudnn", "tilelang", "triton"]
    line = [r.getMessage() for r in caplog.records if "--attn auto: tilelang" in r.getMessage()]
    assert len(line) == 1 and "tilelang 4.00 ms, triton 6.00 ms, cudnn 9.00 ms" in line[0], line
    stored = json.loads(path.read_text())
    key = "NVIDIA H200|torch=2.11,triton=3.6|" + SHAPE.bucket()
    assert stored == {key: {"ms": {"cudnn": 9.0, "tilelang": 4.0, "triton": 6.0}}}
    # second run: read from the cache, nothing measured; the timer's new figures are not consulted
    again = Timer({"cudnn": 1.0, "tilelang": 4.0, "triton": 6.0})
    assert _rank(["cudnn", "tilelang", "triton"], again, path)[0] == ["tilelang", "triton", "cudnn"]
    assert again.calls == []


def test_cache_key_invalidates_by_gpu_versions_and_shape(tmp_path):
    path = tmp_path / "c.json"
    _rank(["triton", "tilelang"], Timer({"triton": 2.0, "tilelang": 3.0}), path)
    for kw in (dict(gpu="NVIDIA A100"), dict(versions="torch=2.11,triton=3.7")):
        t = Timer({"triton": 5.0, "tilelang": 3.0})
        assert _rank(["triton", "tilelang"], t, path, **kw)[0] == ["tilelang", "triton"]
        assert len(t.calls) == 2
    other = autotune.AttnShape(heads=32, d_qk=576, d_v=512, topk=2048, index_heads=32, index_dim=128)
    t = Timer({"triton": 1.0, "tilelang": 3.0})
    order, _ = autotune.rank([Fake("triton"), Fake("tilelang")], other, measure=t, cache_path=path,
                             gpu="NVIDIA H200", versions="torch=2.11,triton=3.6", cuda=True)
    assert [b.name for b in order] == ["triton", "tilelang"] and len(t.calls) == 2
    assert len(json.loads(path.read_text())) == 4
    # a backend new to an entry is measured alone, the others come from the cache
    t = Timer({"triton": 9.0, "tilelang": 9.0, "cudnn": 0.5})
    assert _rank(["cudnn", "triton", "tilelang"], t, path)[0] == ["cudnn", "triton", "tilelang"]
    assert [c[0] for c in t.calls] == ["cudnn"]


def test_corrupt_cache_warns_once_and_is_rewritten(tmp_path, caplog):
    path = tmp_path / "c.json"
    path.write_text("{not json")
    autotune._warned_corrupt.clear()
    with caplog.at_level(logging.WARNING, logger="megatron_glm5.ops"):
        assert _rank(["triton", "tilelang"], Timer({"triton": 2.0, "tilelang": 1.0}), path)[0] == \
            ["tilelang", "triton"]
    warnings = [r for r in caplog.records if "unreadable benchmark cache" in r.getMessage()]
    assert len(warnings) == 1 and str(path) in warnings[0].getMessage()
    assert list(json.loads(path.read_text()).values()) == [{"ms": {"triton": 2.0, "tilelang": 1.0}}]
    assert not [p for p in tmp_path.iterdir() if p.name != "c.json"]  # no temporary file left behind


def test_no_benchmark_on_cpu_or_one_backend_and_fixed_order_on_failure(tmp_path, caplog):
    path = tmp_path / "c.json"
    t = Timer({"triton": 2.0, "tilelang": 1.0})
    assert _rank(["triton", "tilelang"], t, path, cuda=False) == (["triton", "tilelang"], None)
    assert _rank(["triton"], t, path) == (["triton"], None)
    assert t.calls == [] and not path.exists()
    broken = Timer({"cudnn": RuntimeError("no kernel"), "tilelang": RuntimeError("compile failed")})
    with caplog.at_level(logging.WARNING, logger="megatron_glm5.ops"):
        assert _rank(["cudnn", "tilelang"], broken, path)[0] == ["cudnn", "tilelang"]
    assert sum("benchmark of" in r.getMessage() for r in caplog.records) == 2
    # one failing backend goes last, the measured ones are ranked
    mixed = Timer({"cudnn": RuntimeError("x"), "tilelang": 3.0, "triton": 2.0})
    assert _rank(["cudnn", "tilelang", "triton"], mixed, tmp_path / "d.json")[0] == ["triton", "tilelang", "cudnn"]


def test_tie_margin_keeps_fixed_order():
    ms = {"cudnn": 10.2, "tilelang": 10.0, "triton": 12.0}
    assert autotune._order(["cudnn", "tilelang", "triton"], ms) == ["cudnn", "tilelang", "triton"]
    ms["tilelang"] = 9.0  # 13 % faster: ranked first
    assert autotune._order(["cudnn", "tilelang", "triton"], ms) == ["tilelang", "cudnn", "triton"]


def test_cache_location_and_shape_from_config(tmp_path):
    assert autotune.cache_file({autotune.CACHE_ENV: str(tmp_path)}) == tmp_path / "attn_auto.json"
    assert autotune.cache_file({"HOME": "/x"}).name == "attn_auto.json"
    from megatron_glm5.config import GLM5Config

    tcfg = GLM5Config.from_preset("tiny").to_transformer_config()
    s = autotune.shape_from_config(tcfg, seq_length=100)
    assert (s.heads, s.d_v, s.d_qk, s.tokens) == (tcfg.num_attention_heads, tcfg.kv_lora_rank,
                                                 tcfg.kv_lora_rank + tcfg.qk_pos_emb_head_dim, 128)
    assert s.topk == min(tcfg.dsa_index_topk, 128)


def test_registry_auto_without_gpu_uses_fixed_order_and_no_benchmark(monkeypatch):
    calls = []
    monkeypatch.setattr(autotune, "rank", lambda *a, **k: calls.append(a) or (a[0], None))
    backend = registry.get_backend("auto", shape=SHAPE)
    expected = next(registry.BACKENDS[n] for n in registry.AUTO_PREFERENCE
                    if registry.BACKENDS[n].implemented and registry.BACKENDS[n].available())
    assert backend is expected
    if backend.name == "torch":
        assert calls == []


def test_registry_auto_asks_the_ranking_once_per_shape(monkeypatch):
    class Ready(Fake):
        implemented = True

        def available(self):
            return True

    fakes = {n: Ready(n) for n in registry.AUTO_PREFERENCE}
    monkeypatch.setattr(registry, "BACKENDS", fakes)
    monkeypatch.setattr(registry, "_measured", {})
    monkeypatch.setattr(registry, "_log_once", lambda *a: None)
    calls = []

    def fake_rank(candidates, shape):
        calls.append([b.name for b in candidates])
        return list(reversed(candidates)), {}

    monkeypatch.setattr(autotune, "rank", fake_rank)
    assert registry.get_backend("auto", shape=SHAPE).name == "triton"  # torch is not a candidate next to GPU ones
    assert registry.get_backend("auto", shape=SHAPE).name == "triton"
    assert calls == [["cudnn", "tilelang", "flashmla", "triton"]]
    assert registry.get_backend("auto").name == "cudnn"  # no shape: the fixed order


def test_training_measures_at_the_runs_shape_on_rank_0_and_broadcasts(monkeypatch):
    """training/loop.auto_attention_backend: with CUDA, rank 0 asks the registry for the run's shape (TP-local heads,
    the sequence bucket); the other ranks take rank 0's choice from a broadcast and measure nothing."""
    import argparse

    import torch

    import megatron_glm5.ops as ops
    from megatron_glm5.config import GLM5Config
    from megatron_glm5.training import loop

    cfg = GLM5Config.from_preset("tiny")
    args = argparse.Namespace(model_config=cfg, seq_length=100)
    asked = []
    monkeypatch.setattr(ops, "get_backend", lambda name, shape=None: asked.append((name, shape)) or Fake("tilelang"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert loop.auto_attention_backend(args, {"tensor_model_parallel_size": 2, "dsa_backend": "auto"}) == "tilelang"
    (name, shape), = asked
    assert name == "auto" and shape.heads == cfg.num_attention_heads // 2 and shape.tokens == 128
    assert shape.d_v == cfg.kv_lora_rank and shape.topk == min(cfg.index_topk, 128)

    broadcasts = []

    def broadcast(objs, src):
        broadcasts.append((list(objs), src))
        objs[0] = "cudnn"  # what rank 0 sent

    monkeypatch.setattr(loop.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(loop.dist, "get_world_size", lambda: 4)
    monkeypatch.setattr(loop.dist, "get_rank", lambda: 3)
    monkeypatch.setattr(loop.dist, "broadcast_object_list", broadcast)
    asked.clear()
    assert loop.auto_attention_backend(args, {"dsa_backend": "auto"}) == "cudnn"
    assert asked == [] and broadcasts == [([None], 0)]
    monkeypatch.setattr(loop.dist, "get_rank", lambda: 0)
    assert loop.auto_attention_backend(args, {"dsa_backend": "auto"}) == "cudnn"  # rank 0 sends its own
    assert len(asked) == 1 and broadcasts[-1] == (["tilelang"], 0)
