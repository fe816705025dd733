"""The checkpoint converters (tools/convert_hf_to_megatron.py, tools/convert_megatron_to_hf.py, verify_conversion.py).

- HF -> torch_dist -> HF is bitwise identical (names, shapes, dtypes incl. the fp32 router bias) for every tiny
  preset (all IndexShare encodings) with an MTP layer, at every recorded layout;
- the converted checkpoint loads with megatron-core's dist_checkpointing into our model at TP1 (in process) and
  at TP2 and EP2 (2 gloo processes), every local shard equal to the HF tensors and the logits equal;
- finetune_glm5.py trains from it and its step-0 loss equals transformers' loss on the same micro-batch;
- a trained checkpoint exports to a directory transformers loads, with matching logits;
- FP8 (e4m3, block scales, the indexer's wk included) is dequantised on import;
- the plan covers every HF tensor of the real presets exactly once (meta tensors);
- bad inputs give one-line errors naming the file or flag, exit 2, and leave the target untouched.

Run as a script under torchrun, this file is the multi-process worker of test_loads_at_tp2_and_ep2.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = ["tiny", "tiny-indexshare", "tiny-groups"]
LAYOUTS = [dict(tp=1, pp=1, ep=1), dict(tp=2, pp=1, ep=1), dict(tp=1, pp=2, ep=1), dict(tp=1, pp=1, ep=2),
           dict(tp=2, pp=2, ep=2)]
REAL = ["glm5", "glm5.1", "glm5.2", "glm5.3"]


# ============================================================================ helpers
def _mtp_tensors(cfg, seed=11):
    """HF-named MTP tensors (layer num_hidden_layers) from our randomly initialised model: transformers does not
    save GLM-5's MTP layer, the real checkpoints do."""
    import megatron_glm5
    from megatron_glm5 import build_model
    from megatron_glm5.conversion.hf_mapping import mcore_to_hf

    megatron_glm5.initialize_model_parallel(seed=seed)
    ours = build_model(cfg)
    state = {k: v for k, v in ours.state_dict().items() if torch.is_tensor(v)}
    prefix = f"model.layers.{cfg.num_hidden_layers}."
    return {k: v.detach().clone().contiguous() for k, v in mcore_to_hf(state, cfg).items() if k.startswith(prefix)}


def _write_sharded(state: dict, directory, n_shards: int) -> None:
    keys = sorted(state)
    weight_map = {}
    for i in range(n_shards):
        name = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {k: state[k] for k in keys[i::n_shards]}
        save_file(part, os.path.join(directory, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)


def make_hf_dir(preset, directory, bf16=False, sharded=0, seed=7):
    """A tiny transformers checkpoint plus an MTP layer (its embed_tokens/shared_head.head = the main ones).
    ``bf16``: weights in bf16 with the router bias kept fp32 (as the real checkpoints store them)."""
    from hf_tiny import make_hf_model, save_hf_model

    hf, cfg = make_hf_model(preset, seed=seed)
    save_hf_model(hf, directory)
    state = load_file(os.path.join(directory, "model.safetensors"))
    state.update(_mtp_tensors(cfg))
    prefix = f"model.layers.{cfg.num_hidden_layers}."
    state[prefix + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    state[prefix + "shared_head.head.weight"] = state["lm_head.weight"].clone()
    if bf16:
        state = {k: (v if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16)) for k, v in state.items()}
        c = json.loads(open(os.path.join(directory, "config.json")).read())
        c["dtype"] = "bfloat16"
        (open(os.path.join(directory, "config.json"), "w")).write(json.dumps(c, indent=2))
    os.remove(os.path.join(directory, "model.safetensors"))
    if sharded:
        _write_sharded(state, directory, sharded)
    else:
        save_file(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    return str(directory), cfg, hf


def read_hf(directory) -> dict:
    from megatron_glm5.conversion.safetensors_stream import SafetensorsSource

    src = SafetensorsSource(str(directory))
    try:
        return {k: src.read_rows(k) for k in src.keys()}
    finally:
        src.close()


def assert_bitwise_same(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k


def to_megatron(hf_dir, out, **kw):
    from megatron_glm5.conversion.convert import convert_hf_to_megatron
    return convert_hf_to_megatron(str(hf_dir), str(out), progress=False, **kw)


def to_hf(ckpt, out, **kw):
    from megatron_glm5.conversion.convert import convert_megatron_to_hf
    return convert_megatron_to_hf(str(ckpt), str(out), progress=False, **kw)


def glm5_entry(ckpt):
    from megatron_glm5.conversion.convert import read_glm5_entry, resolve_checkpoint_dir
    from megatron_glm5.conversion.torch_dist_stream import TorchDistReader

    path = resolve_checkpoint_dir(str(ckpt))
    return read_glm5_entry(path, TorchDistReader(path))


def training_args(ckpt, extra=(), world_size=1):
    """The real training flags for loading ``ckpt`` (a converted checkpoint) with --finetune."""
    from megatron_glm5.arguments import parse_args, validate_args

    argv = ["--hf-config", os.path.join(str(ckpt), "config.json"), "--load", str(ckpt), "--finetune",
            "--tokenizer", "tiny", "--no-save", "--attn", "torch", *extra]
    return validate_args(parse_args(argv, mode="finetune"), world_size=world_size)


# ============================================================================ fixtures
@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """preset -> (hf_dir, cfg, transformers model); tiny-indexshare in bf16 (+ fp32 router bias), others fp32."""
    out = {}
    for preset in PRESETS:
        d = tmp_path_factory.mktemp(f"hf_{preset}")
        out[preset] = make_hf_dir(preset, d, bf16=(preset == "tiny-indexshare"), sharded=3 if preset == "tiny" else 0)
    return out


INDEXSHARE_ENCODINGS = {  # the same tiny-indexshare weights (layers F S F S) under each config.json encoding
    "tiny-indexshare:list": {},
    "tiny-indexshare:pattern": {"indexer_types": None, "index_topk_pattern": "FSFS"},
    "tiny-indexshare:freq": {"indexer_types": None, "index_topk_freq": 2, "index_skip_topk_offset": 1},
}


def hf_dir_for(name, hf_dirs, tmp_path):
    """A preset's HF directory, or tiny-indexshare with its IndexShare schedule encoded another way."""
    if ":" not in name:
        return hf_dirs[name][0]
    d = shutil.copytree(hf_dirs["tiny-indexshare"][0], tmp_path / "hf_variant")
    config = json.loads((d / "config.json").read_text())
    for k, v in INDEXSHARE_ENCODINGS[name].items():
        if v is None:
            config.pop(k, None)
        else:
            config[k] = v
    (d / "config.json").write_text(json.dumps(config, indent=2))
    return str(d)


@pytest.fixture(scope="module")
def converted(hf_dirs, tmp_path_factory):
    """The tiny (fp32) checkpoint converted at TP1."""
    out = tmp_path_factory.mktemp("conv") / "tiny_mc"
    to_megatron(hf_dirs["tiny"][0], out)
    return out


# ============================================================================ table pieces
def test_placements_rebuild_the_megatron_tensor():
    from megatron_glm5.conversion.hf_mapping import (
        TensorMapping,
        hf_placements,
        hf_shapes_from_mcore,
        hf_to_mcore_tensor,
        mcore_shape_from_hf,
    )

    g = torch.Generator().manual_seed(0)
    cases = [TensorMapping("a", ("x",), "copy"), TensorMapping("b", ("g", "u"), "glu"),
             TensorMapping("c", tuple(f"d{e}" for e in range(3)), "experts"),
             TensorMapping("d", tuple(f"{p}{e}" for e in range(3) for p in "gu"), "experts_glu")]
    for row in cases:
        shapes = [(4, 6)] * len(row.hf)
        hf = [torch.randn(s, generator=g) for s in shapes]
        ref = hf_to_mcore_tensor(row, hf)
        assert mcore_shape_from_hf(row, shapes) == tuple(ref.shape)
        assert hf_shapes_from_mcore(row, ref.shape) == shapes
        built = torch.full_like(ref, float("nan"))
        for t, p in zip(hf, hf_placements(row, shapes)):
            for r0, r1 in ((0, 1), (1, 4)):  # row blocks
                offsets, sizes = p.mcore_block(t.shape, r0, r1)
                built[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] = t[r0:r1].view(sizes)
        assert torch.equal(built, ref), row.kind


# ============================================================================ round trip
@pytest.mark.parametrize("preset", ["tiny", "tiny-groups", *INDEXSHARE_ENCODINGS])
def test_round_trip_is_bitwise_at_every_layout(preset, hf_dirs, tmp_path):
    from megatron_glm5 import GLM5Config

    _, cfg, _ = hf_dirs[preset.split(":")[0]]
    hf_dir = hf_dir_for(preset, hf_dirs, tmp_path)
    assert GLM5Config.from_hf(hf_dir).indexer_types == cfg.indexer_types
    original = read_hf(hf_dir)
    mtp = f"model.layers.{cfg.num_hidden_layers}."
    assert f"{mtp}eh_proj.weight" in original and f"{mtp}mlp.experts.3.up_proj.weight" in original
    bias = original["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32
    if preset.startswith("tiny-indexshare"):
        assert original["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
        assert "model.layers.1.self_attn.indexer.wk.weight" not in original  # a shared-indexer layer
    source_config = json.loads(open(os.path.join(hf_dir, "config.json")).read())
    for i, layout in enumerate(LAYOUTS):
        mc, back = tmp_path / f"mc{i}", tmp_path / f"hf{i}"
        summary = to_megatron(hf_dir, mc, **layout)
        assert summary["mtp"] and os.path.isfile(mc / "metadata.json") and os.path.isfile(mc / "config.json")
        entry = glm5_entry(mc)
        assert entry.layout["tensor_model_parallel_size"] == layout["tp"]
        assert entry.layout["pipeline_model_parallel_size"] == layout["pp"]
        assert entry.layout["expert_model_parallel_size"] == layout["ep"]
        assert entry.model_config == source_config
        to_hf(mc, back, max_shard_size="200KB")
        assert_bitwise_same(original, read_hf(back))
        assert json.loads(open(back / "config.json").read()) == source_config
        index = json.loads(open(back / "model.safetensors.index.json").read())
        assert len(set(index["weight_map"].values())) > 1  # sharded per --max-shard-size
        assert index["weight_map"][f"{mtp}shared_head.head.weight"]
        shutil.rmtree(mc)
        shutil.rmtree(back)


def test_converted_loads_into_the_model_at_tp1(hf_dirs, converted):
    """megatron-core's dist_checkpointing.load (through the trainer's load_checkpoint) gives our model exactly the
    tensors from_hf_pretrained reads from the HF directory, MTP included."""
    import megatron_glm5
    from megatron_glm5.arguments import args_to_overrides
    from megatron_glm5.model.model import build_model
    from megatron_glm5.training.checkpointing import load_checkpoint

    hf_dir, cfg, _ = hf_dirs["tiny"]
    ref = megatron_glm5.from_hf_pretrained(hf_dir)
    megatron_glm5.initialize_model_parallel(seed=99)  # different init: the load must overwrite everything
    args = training_args(converted)
    model = build_model(args.model_config, mtp=args.mtp, **args_to_overrides(args))
    assert load_checkpoint(str(converted), [model], None, None, args) == {"iteration": 0, "data_state": {}}
    theirs = {k: v for k, v in ref.state_dict().items() if torch.is_tensor(v)}
    ours = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
    assert sorted(ours) == sorted(theirs) and any(k.startswith("mtp.") for k in ours)
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k


def test_interrupted_conversion_leaves_no_target(hf_dirs, tmp_path, monkeypatch):
    from megatron_glm5.conversion import convert

    calls = {"n": 0}
    real = convert._produce_block

    def failing(*a, **k):
        calls["n"] += 1
        if calls["n"] == 40:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(convert, "_produce_block", failing)
    out = tmp_path / "mc"
    with pytest.raises(KeyboardInterrupt):
        to_megatron(hf_dirs["tiny"][0], out)
    assert not out.exists() and not (tmp_path / "mc.partial").exists()


# ============================================================================ multi-process load
def _dist_worker(ckpt, ref_dir):
    """torchrun worker: load the converted checkpoint at TP2 (ETP2) and at EP2, compare every local shard with the
    HF tensors (bitwise) and write the gathered logits of a prompt."""
    import torch.distributed as dist

    import megatron_glm5  # noqa: F401  (CPU shims before megatron-core is imported)
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from megatron_glm5 import platform
    from megatron_glm5.arguments import args_to_overrides
    from megatron_glm5.model.model import build_model
    from megatron_glm5.training.checkpointing import load_checkpoint

    ref = torch.load(os.path.join(ref_dir, "ref_state.pt"))
    ids = torch.load(os.path.join(ref_dir, "ids.pt"))
    for name, tp, ep in (("tp2", 2, 1), ("ep2", 1, 2)):
        args = training_args(ckpt, ["--tp", str(tp), "--ep", str(ep)], world_size=2)
        platform.initialize_model_parallel(tp=tp, ep=ep)
        model = build_model(args.model_config, mtp=args.mtp, **args_to_overrides(args))
        load_checkpoint(ckpt, [model], None, None, args)
        sd = model.sharded_state_dict()
        apply_factories(sd)
        checked = 0
        for key, value in sd.items():
            for sh in (value if isinstance(value, list) else [value]):
                if isinstance(sh, ShardedTensor):
                    block = ref[key][tuple(slice(o, o + s) for o, s in zip(sh.global_offset, sh.local_shape))]
                    assert torch.equal(block, sh.data), (name, key, sh.global_offset)
                    checked += 1
        with torch.no_grad():
            logits = model.eval()(ids)
        if logits.shape[-1] != args.model_config.vocab_size:  # vocab-parallel output
            parts = [torch.empty_like(logits) for _ in range(tp)]
            dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
            logits = torch.cat(parts, -1)
        if dist.get_rank() == 0:
            torch.save(logits, os.path.join(ref_dir, f"logits_{name}.pt"))
        print(f"{name} rank {dist.get_rank()}: {checked} shards equal", flush=True)
    platform.end_of_job()


@pytest.mark.distributed
def test_loads_at_tp2_and_ep2(hf_dirs, converted, tmp_path):
    import megatron_glm5

    hf_dir, cfg, _ = hf_dirs["tiny"]
    ref = megatron_glm5.from_hf_pretrained(hf_dir)
    torch.save({k: v for k, v in ref.state_dict().items() if torch.is_tensor(v)}, tmp_path / "ref_state.pt")
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))  # <= index_topk
    torch.save(ids, tmp_path / "ids.pt")
    with torch.no_grad():
        expected = ref(ids)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           os.path.abspath(__file__), str(converted), str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for name in ("tp2", "ep2"):
        assert f"{name} rank 1:" in proc.stdout and f"{name} rank 0:" in proc.stdout
        got = torch.load(tmp_path / f"logits_{name}.pt")
        assert got.shape == expected.shape
        assert ((got - expected).norm() / expected.norm()).item() < 1e-5, name


# ============================================================================ training from a converted checkpoint
FINETUNE_FLAGS = ["--train-iters", "2", "--tokenizer", "tiny", "--no-packing", "--micro-batch-size", "2",
                  "--global-batch-size", "2", "--seq-length", "64", "--attn", "torch", "--log-interval", "1",
                  "--eval-iters", "0", "--seed", "1234"]


@pytest.fixture(scope="module")
def finetuned(converted, tmp_path_factory):
    """finetune_glm5.py --load <converted> --finetune for 2 iterations; returns (save root, metrics rows)."""
    work = tmp_path_factory.mktemp("ft")
    argv = [sys.executable, "finetune_glm5.py", "--hf-config", str(converted / "config.json"), "--load",
            str(converted), "--finetune", "--save", str(work / "save"), "--tensorboard-dir", str(work / "tb"),
            *FINETUNE_FLAGS]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(work / "tb" / "metrics.jsonl")]
    return work / "save", rows


def test_finetune_step0_loss_equals_transformers_loss(hf_dirs, converted, finetuned):
    """The trainer's first logged lm loss (computed before the first update) equals transformers' loss on the
    exact first micro-batch the trainer draws (rebuilt with the trainer's own flags and data pipeline)."""
    import megatron_glm5
    from megatron_glm5.data.tokenizer import load_tokenizer
    from megatron_glm5.training.data import build_streams

    _, cfg, hf = hf_dirs["tiny"]
    _, rows = finetuned
    step1 = next(r for r in rows if r.get("iteration") == 1 and "lm-loss" in r)
    megatron_glm5.initialize_model_parallel()
    args = training_args(converted, FINETUNE_FLAGS)
    train, _ = build_streams(args, load_tokenizer(args.tokenizer))
    batch = next(train)
    assert batch["tokens"].shape == (2, 64) and batch["loss_mask"].sum() > 0
    with torch.no_grad():
        logits = hf(input_ids=batch["tokens"], position_ids=batch["position_ids"]).logits.float()
    losses = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]),
                                               batch["labels"].view(-1).clamp(min=0), reduction="none")
    mask = batch["loss_mask"].view(-1).float()
    expected = (losses * mask).sum() / mask.sum()
    print("step-0 loss: trainer", step1["lm-loss"], "transformers", expected.item())
    assert step1["lm-loss"] == pytest.approx(expected.item(), rel=2e-6, abs=1e-6)


def test_trained_checkpoint_exports_to_transformers(hf_dirs, finetuned, tmp_path):
    """A --save root (latest pointer, optimizer state inside) exports to an HF directory that
    AutoModelForCausalLM / AutoTokenizer load; its logits equal our model loaded from the training checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_glm5.conversion.verify import load_megatron_model

    save_root, _ = finetuned
    out = tmp_path / "export"
    summary = to_hf(save_root, out, tokenizer="tiny")
    assert summary["source"].endswith("iter_0000002") and summary["mtp"]
    files = set(os.listdir(out))
    assert {"config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
            "tokenizer_config.json", "chat_template.jinja"} <= files
    on_disk = read_hf(out)
    _, cfg, _ = hf_dirs["tiny"]
    mtp = f"model.layers.{cfg.num_hidden_layers}."
    assert torch.equal(on_disk[mtp + "embed_tokens.weight"], on_disk["model.embed_tokens.weight"])
    assert torch.equal(on_disk[mtp + "shared_head.head.weight"], on_disk["lm_head.weight"])
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in on_disk  # per-expert names on disk
    assert on_disk["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    theirs = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, attn_implementation="eager").eval()
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = torch.tensor([tok.encode("hello world, this is a test")[:14]])
    ours, _ = load_megatron_model(str(save_root))
    with torch.no_grad():
        a, b = theirs(input_ids=ids).logits, ours(ids)
    assert ((a - b).norm() / b.norm()).item() < 1e-5
    # trained weights (not the converted ones) were exported
    assert not torch.equal(on_disk["lm_head.weight"], read_hf(hf_dirs["tiny"][0])["lm_head.weight"])


def test_reader_reads_blocks_of_large_stored_chunks(finetuned):
    """Training checkpoints store whole tensors per rank (all experts of a layer in one chunk at EP1): blocks are
    read without loading the chunk, and equal slices of the whole tensor."""
    from megatron_glm5.conversion.torch_dist_stream import TorchDistReader

    save_root, _ = finetuned
    reader = TorchDistReader(str(save_root / "iter_0000002"))
    key = "decoder.layers.1.mlp.experts.weight1"
    assert [s for _, s, _ in reader._chunks[key]] == [reader.shape(key)]
    whole = reader.read_region(key, (0, 0, 0, 0), reader.shape(key))
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        lo = [int(torch.randint(0, d, (1,), generator=g)) for d in whole.shape]
        n = [int(torch.randint(1, d - l + 1, (1,), generator=g)) for l, d in zip(lo, whole.shape)]
        before = reader.bytes_read
        block = reader.read_region(key, lo, n)
        assert torch.equal(block, whole[tuple(slice(l, l + k) for l, k in zip(lo, n))])
        assert reader.bytes_read - before <= max(2 * block.nbytes, 64 * 2 ** 20)
    reader.close()


def test_verify_tool(hf_dirs, converted, capsys):
    from megatron_glm5.conversion.cli import verify_main

    assert verify_main(["--hf-dir", hf_dirs["tiny"][0], "--megatron", str(converted), "--logits",
                        "--transformers"]) == 0
    out = capsys.readouterr().out
    assert "0 different" in out and "verify: OK" in out
    assert "ours(torch_dist) vs ours(HF): relative L2 0.000e+00" in out


# ============================================================================ FP8
def _quantize_fp8(w: torch.Tensor, block):
    b0, b1 = block
    rows, cols = w.shape
    nr, nc = -(-rows // b0), -(-cols // b1)
    scale = torch.empty(nr, nc)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(nr):
        for j in range(nc):
            blk = w[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1].float()
            s = blk.abs().max().clamp(min=1e-12) / 448.0
            scale[i, j] = s
            q[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1] = (blk / s).to(torch.float8_e4m3fn)
    return q, scale


def test_fp8_checkpoint_is_dequantised_on_import(hf_dirs, tmp_path):
    """FP8 e4m3 weights with 128x128-style block scales (16x16 here, read from quantization_config) become
    bf16 = fp8 * scale_inv per block; the indexer's wk is scaled like every other weight."""
    from megatron_glm5.conversion.torch_dist_stream import TorchDistReader

    src, cfg, _ = hf_dirs["tiny"]
    block = (16, 16)
    state = read_hf(src)
    fp8 = {}
    for k in list(state):
        v = state[k]
        if v.dim() == 2 and (k.endswith("proj.weight") or k.endswith(("wq_b.weight", "wk.weight"))):
            q, s = _quantize_fp8(v, block)
            state[k], state[k[: -len("weight")] + "weight_scale_inv"] = q, s
            expected = (q.float() * s.repeat_interleave(16, 0)[: v.shape[0]].repeat_interleave(16, 1)[:, : v.shape[1]])
            fp8[k] = expected.to(torch.bfloat16)
    assert "model.layers.0.self_attn.indexer.wk.weight" in fp8
    d = tmp_path / "fp8"
    d.mkdir()
    config = json.loads(open(os.path.join(src, "config.json")).read())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (d / "config.json").write_text(json.dumps(config))
    save_file(state, str(d / "model.safetensors"))
    out = tmp_path / "mc"
    to_megatron(d, out)
    entry = glm5_entry(out)
    assert "quantization_config" not in entry.model_config and entry.model_config["dtype"] == "bfloat16"
    assert entry.source["fp8_dequantized"]
    back = tmp_path / "hf"
    to_hf(out, back)
    exported = read_hf(back)
    assert not any(k.endswith("scale_inv") for k in exported)
    for k, ref in fp8.items():
        assert exported[k].dtype == torch.bfloat16 and torch.equal(exported[k], ref), k
    # the non-FP8 tensors keep their dtype (fp32 here)
    assert exported["model.norm.weight"].dtype == torch.float32
    reader = TorchDistReader(str(out))
    wk = reader.read_region("decoder.layers.0.self_attention.core_attention.indexer.linear_wk.weight", (0, 0),
                            reader.shape("decoder.layers.0.self_attention.core_attention.indexer.linear_wk.weight"))
    assert torch.equal(wk, fp8["model.layers.0.self_attn.indexer.wk.weight"])


# ============================================================================ full scale (meta tensors)
@dataclass
class _Info:
    dtype: torch.dtype
    shape: tuple
    file: str = "model-00001-of-00001.safetensors"

    @property
    def dtype_name(self):
        from megatron_glm5.conversion.safetensors_stream import DTYPE_NAMES
        return DTYPE_NAMES[self.dtype]


class _HeaderOnlySource:
    """Names, dtypes and shapes of a checkpoint without data (what the converter's preflight sees)."""

    def __init__(self, infos):
        self.infos = infos
        self.directory = "<meta>"

    def keys(self):
        return self.infos.keys()

    def __contains__(self, k):
        return k in self.infos

    def info(self, k):
        return self.infos[k]

    def read_rows(self, *a):
        raise AssertionError("planning must not read data")


def _assert_tiles(chunks, global_shape):
    """The chunk boxes of one tensor are disjoint and cover it: rasterise the axes that any chunk splits."""
    import numpy as np

    split = [d for d in range(len(global_shape)) if any(c.sizes[d] != global_shape[d] for c in chunks)]
    grid = np.zeros([global_shape[d] for d in split] or [1], dtype=np.int32)
    for c in chunks:
        assert all(c.offsets[d] == 0 for d in range(len(global_shape)) if d not in split)
        grid[tuple(slice(c.offsets[d], c.offsets[d] + c.sizes[d]) for d in split)] += 1
    assert (grid == 1).all()


@pytest.mark.parametrize("name", REAL)
def test_plan_covers_every_hf_tensor_at_full_scale(name):
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    from megatron_glm5 import GLM5Config
    from megatron_glm5.conversion.convert import megatron_checkpoint_spec, plan_import
    from megatron_glm5.conversion.hf_mapping import conversion_plan, hf_fused_to_disk_names, hf_shapes_from_mcore

    cfg = GLM5Config.from_preset(name)
    with torch.device("meta"):
        theirs = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**cfg.to_hf()))
    infos = {k: _Info(torch.bfloat16, tuple(v.shape)) for k, v in hf_fused_to_disk_names(theirs.state_dict()).items()}
    for k in infos:
        if k.endswith("e_score_correction_bias"):
            infos[k] = _Info(torch.float32, infos[k].shape)
    spec = megatron_checkpoint_spec(cfg, mtp=True)
    mtp = f"model.layers.{cfg.num_hidden_layers}."
    assert not any(k.startswith(mtp) for k in infos)  # transformers has no MTP layer: add it as on disk
    for row in conversion_plan(cfg, include_mtp=True):
        if not row.hf[0].startswith(mtp):
            continue
        if row.kind == "tied":
            main = "model.embed_tokens.weight" if row.tied_to.startswith("embedding") else "lm_head.weight"
            infos[row.hf[0]] = infos[main]
            continue
        for k, s in zip(row.hf, hf_shapes_from_mcore(row, spec.tensors[row.mcore].global_shape)):
            infos[k] = _Info(torch.float32 if k.endswith("bias") and "gate" in k else torch.bfloat16, tuple(s))
    plan = plan_import(cfg, _HeaderOnlySource(infos), spec, include_mtp=True, dtype=None)
    tied = {copy for copy, _ in plan.tied}
    assert tied == {mtp + "embed_tokens.weight", mtp + "shared_head.head.weight"}
    assert plan.used == set(infos)  # every HF tensor accounted for ...
    per_source = Counter(c.source for c in plan.chunks)
    assert set(per_source) == set(infos) - tied  # ... and written from exactly one place (row blocks of it)
    by_key = {}
    for c in plan.chunks:
        by_key.setdefault(c.key, []).append(c)
    assert set(by_key) == {s.key for s in spec.tensors.values()}
    for s in spec.tensors.values():
        _assert_tiles(by_key[s.key], s.global_shape)
    assert max(c.nbytes for c in plan.chunks) <= 64 * 2 ** 20
    assert plan.total_bytes == sum(math.prod(s.global_shape) * (4 if s.key.endswith("expert_bias") else 2)
                                   for s in spec.tensors.values())
    if name in ("glm5.2", "glm5.3"):  # IndexShare: 21 full-indexer layers + MTP
        assert sum(1 for k in infos if k.endswith("indexer.wk.weight")) == 22


# ============================================================================ bad input
def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _bad_missing_shard(d):
    os.remove(d / "model-00002-of-00003.safetensors")
    return "model-00002-of-00003.safetensors"


def _bad_index_names_missing_file(d):
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = "model-00009-of-00009.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return "model-00009-of-00009.safetensors"


def _bad_truncated(d):
    p = d / "model-00001-of-00003.safetensors"
    data = p.read_bytes()
    p.write_bytes(data[: len(data) * 2 // 3])
    return "model-00001-of-00003.safetensors"


def _bad_architecture(d):
    c = json.loads((d / "config.json").read_text())
    c["model_type"], c["architectures"] = "llama", ["LlamaForCausalLM"]
    (d / "config.json").write_text(json.dumps(c))
    return "config.json"


def _rewrite_tensor(d, key, fn):
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shard = d / index["weight_map"][key]
    state = load_file(str(shard))
    fn(state)
    save_file(state, str(shard), metadata={"format": "pt"})
    index["weight_map"].update({k: shard.name for k in state})
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return shard.name


def _bad_int8(d):
    key = "model.layers.0.self_attn.q_a_proj.weight"

    def fn(state):
        state[key] = state[key].to(torch.int8)
    return _rewrite_tensor(d, key, fn)


def _bad_fp8_without_scale(d):
    key = "model.layers.2.mlp.experts.5.down_proj.weight"

    def fn(state):
        state[key] = state[key].to(torch.float8_e4m3fn)
    return _rewrite_tensor(d, key, fn)


def _bad_shape(d):
    key = "model.layers.3.self_attn.o_proj.weight"

    def fn(state):
        state[key] = state[key][:, :-1].contiguous()
    return _rewrite_tensor(d, key, fn)


def _bad_nan(d):
    key = "model.layers.2.mlp.experts.5.down_proj.weight"

    def fn(state):
        state[key][3, 1] = float("nan")
    return _rewrite_tensor(d, key, fn)


def _bad_inf(d):
    key = "model.norm.weight"

    def fn(state):
        state[key][0] = float("-inf")
    return _rewrite_tensor(d, key, fn)


BAD = {
    "nan_weight": (_bad_nan, ["experts.5.down_proj.weight has non-finite values (1 NaN, 0 Inf", "row 3",
                              "--allow-nonfinite"]),
    "inf_weight": (_bad_inf, ["model.norm.weight has non-finite values (0 NaN, 1 Inf", "--allow-nonfinite"]),
    "missing_shard": (_bad_missing_shard, []),
    "index_names_missing_file": (_bad_index_names_missing_file, []),
    "truncated": (_bad_truncated, ["truncated"]),
    "wrong_architecture": (_bad_architecture, ["model_type", "llama"]),
    "int8_tensor": (_bad_int8, ["q_a_proj.weight", "I8"]),
    "fp8_without_scale": (_bad_fp8_without_scale, ["weight_scale_inv"]),
    "shape": (_bad_shape, ["o_proj.weight", "shape"]),
    "ep_not_dividing": (None, ["--ep 3", "n_routed_experts 8"]),
    "etp_not_dividing": (None, ["--etp 3"]),
    "pp_not_dividing": (None, ["--pp 3"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_error_and_target_untouched(case, hf_dirs, tmp_path, capsys):
    from megatron_glm5.conversion.cli import hf_to_megatron_main

    make_bad, words = BAD[case]
    d = _copy(hf_dirs["tiny"][0], tmp_path / "hf")
    names = [make_bad(d)] if make_bad else []
    flags = {"ep_not_dividing": ["--ep", "3"], "etp_not_dividing": ["--etp", "3"],
             "pp_not_dividing": ["--pp", "3"]}.get(case, [])
    out = tmp_path / "out"
    capsys.readouterr()
    rc = hf_to_megatron_main(["--hf-dir", str(d), "--save", str(out), "--no-progress", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("error: "), err
    for w in names + words:
        assert w in err[0], (w, err[0])
    assert not out.exists() and not (tmp_path / "out.partial").exists()
    # an existing target is left exactly as it was, even with --overwrite
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc = hf_to_megatron_main(["--hf-dir", str(d), "--save", str(out), "--no-progress", "--overwrite", *flags])
    assert rc == 2 and os.listdir(out) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"


def test_allow_nonfinite_converts_with_one_warning_per_tensor(hf_dirs, tmp_path, caplog):
    from megatron_glm5.conversion.cli import hf_to_megatron_main

    d = _copy(hf_dirs["tiny"][0], tmp_path / "hf")
    _bad_nan(d)
    caplog.clear()
    assert hf_to_megatron_main(["--hf-dir", str(d), "--save", str(tmp_path / "out"), "--no-progress",
                                "--allow-nonfinite"]) == 0
    warned = [r.getMessage() for r in caplog.records if "non-finite" in r.getMessage()]
    assert len(warned) == 1 and "experts.5.down_proj.weight" in warned[0] and "--allow-nonfinite" in warned[0]
    back = read_hf(to_hf(tmp_path / "out", tmp_path / "back")["output"])
    assert torch.isnan(back["model.layers.2.mlp.experts.5.down_proj.weight"][3, 1])


def test_progress_counts_in_the_unit_of_its_total(hf_dirs, converted, tmp_path, monkeypatch):
    """The bar's updates add up to its total in both directions (the import counted torch.save record sizes
    against a total of tensor bytes: 1.53 MB of 1.27 MB)."""
    from megatron_glm5.conversion import convert

    bars = []

    class Bar:
        def __init__(self, total, desc, enabled):
            self.total, self.n = total, 0
            bars.append(self)

        def update(self, n):
            self.n += n

        def close(self):
            pass

    monkeypatch.setattr(convert, "_progress", Bar)
    to_megatron(hf_dirs["tiny"][0], tmp_path / "mc")
    to_hf(tmp_path / "mc", tmp_path / "hf")
    assert len(bars) == 2 and all(b.total > 0 for b in bars)
    assert [b.n for b in bars] == [b.total for b in bars]


def test_mtp_presence_is_recorded_and_the_export_follows_it(hf_dirs, converted, tmp_path, caplog):
    """A model saved by transformers has no MTP weights although config.json says num_nextn_predict_layers 1:
    the import records it (read_record(dir).mtp False), the export leaves MTP out by default and refuses --mtp;
    --no-mtp leaves out the MTP layer of a checkpoint that has one (transformers then loads it without
    unexpected keys)."""
    from hf_tiny import make_hf_model, save_hf_model
    from transformers import AutoModelForCausalLM

    from megatron_glm5.checkpoint.format import read_record
    from megatron_glm5.conversion.cli import megatron_to_hf_main

    hf, cfg = make_hf_model("tiny", seed=3)
    save_hf_model(hf, tmp_path / "plain")
    assert cfg.num_nextn_predict_layers == 1
    caplog.clear()
    to_megatron(tmp_path / "plain", tmp_path / "mc")
    assert any("no MTP layer" in r.getMessage() for r in caplog.records)
    record = read_record(str(tmp_path / "mc"))
    assert record.mtp is False and record.source["mtp"] is False
    assert read_record(str(converted)).mtp is True and glm5_entry(converted).source["mtp"] is True
    summary = to_hf(tmp_path / "mc", tmp_path / "back")
    assert not summary["mtp"]
    assert_bitwise_same(read_hf(tmp_path / "back"), read_hf(tmp_path / "plain"))
    assert megatron_to_hf_main(["--load", str(tmp_path / "mc"), "--save", str(tmp_path / "x"), "--mtp"]) == 2
    assert not (tmp_path / "x").exists()
    # a checkpoint with MTP, exported without it
    assert megatron_to_hf_main(["--load", str(converted), "--save", str(tmp_path / "nomtp"), "--no-mtp",
                                "--no-progress"]) == 0
    on_disk = read_hf(tmp_path / "nomtp")
    mtp_prefix = f"model.layers.{cfg.num_hidden_layers}."
    assert on_disk and not any(k.startswith(mtp_prefix) for k in on_disk)
    full = read_hf(hf_dirs["tiny"][0])
    assert_bitwise_same(on_disk, {k: v for k, v in full.items() if not k.startswith(mtp_prefix)})
    _, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "nomtp"), dtype=torch.float32,
                                                   output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"]


def test_existing_target_is_refused(hf_dirs, converted, tmp_path, capsys):
    from megatron_glm5.conversion.cli import hf_to_megatron_main, megatron_to_hf_main

    out = tmp_path / "x"
    out.mkdir()
    assert hf_to_megatron_main(["--hf-dir", hf_dirs["tiny"][0], "--save", str(out)]) == 2
    assert megatron_to_hf_main(["--load", str(converted), "--save", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("--save") == 2 and "already exists" in err and os.listdir(out) == []
    assert megatron_to_hf_main(["--load", str(tmp_path / "nope"), "--save", str(tmp_path / "y")]) == 2
    assert "--load" in capsys.readouterr().err and not (tmp_path / "y").exists()


def test_cli_process_exit_status_and_message(hf_dirs, tmp_path):
    """The real command line: exit status 2 and a single stderr line, before any heavy import."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_hf_to_megatron.py"), "--hf-dir",
                           hf_dirs["tiny"][0], "--save", str(out), "--ep", "3"],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == ["error: --ep 3 does not divide n_routed_experts 8"]
    assert not out.exists()


if __name__ == "__main__":  # torchrun worker of test_loads_at_tp2_and_ep2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    _dist_worker(sys.argv[1], sys.argv[2])


def test_finetune_follows_the_checkpoints_mtp(tmp_path):
    """Fine-tuning a converted model that transformers saved without MTP weights (config.json says 1 MTP layer):
    --load alone takes the model from the checkpoint and trains without MTP (it used to stop asking for --no-mtp);
    --mtp trains a freshly initialised MTP layer, saying so."""
    from hf_tiny import make_hf_model, save_hf_model
    from training_helpers import check_ok, read_metrics, run_entries

    hf, _ = make_hf_model("tiny", seed=4)
    save_hf_model(hf, tmp_path / "plain")
    to_megatron(tmp_path / "plain", tmp_path / "mc")
    flags = ["--load", tmp_path / "mc", "--finetune", "--train-iters", "2", "--lr-warmup-iters", "0",
             "--eval-iters", "0", "--log-interval", "1"]
    plain, fresh = run_entries([("finetune", flags + ["--save", tmp_path / "s1"], tmp_path),
                                ("finetune", flags + ["--mtp", "--save", tmp_path / "s2"], tmp_path)])  # at once
    check_ok(plain)
    assert "holds no MTP weights: training without the MTP layer" in plain.stdout + plain.stderr
    assert not any("mtp-loss" in r for r in read_metrics(tmp_path / "s1" / "tensorboard"))
    check_ok(fresh)
    assert "the MTP layer starts freshly initialised" in fresh.stdout + fresh.stderr
    assert any("mtp-loss" in r for r in read_metrics(tmp_path / "s2" / "tensorboard"))
