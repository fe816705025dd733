"""The frozen FP8 base (issue 15 item 2) and the FP8 export in the release's layout (issue 17 item 1).

- the block-scaled format against a per-block loop written here (partial last blocks, 3-D experts, zero blocks);
- fp8_linear / fp8_grouped_linear: forward and input gradient equal the dequantised fp32 weight's;
- a tiny model with --base-precision fp8 equals the fp32 model holding the dequantised weights (logits and the
  gradients of everything trainable), its from-scratch init is the fp32 init quantised, its checkpoint round trip
  is bitwise;
- conversion: a tiny FP8 release -> --keep-fp8 -> our checkpoint holds its bytes; -> export (auto) gives them back
  bitwise; a bf16 checkpoint -> --dtype fp8 loads in transformers (dequantised on CPU) with logits close to the
  bf16 export's; --dtype fp32 of an FP8 checkpoint writes weight times scale;
- the bad-input lines.
"""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors.torch import save_file

from megatron_glm5.conversion.safetensors_io import HFCheckpointReader

E4M3 = torch.float8_e4m3fn


# ============================================================================ the format, by a loop written here
def _reference_quantize(w: torch.Tensor):
    """Per 128x128 block (partial at the edges): s = amax / 448 (1 for a zero block), q = e4m3(w / s)."""
    n, k = w.shape
    nb, kb = -(-n // 128), -(-k // 128)
    q = torch.empty(n, k, dtype=E4M3)
    s = torch.empty(nb, kb, dtype=torch.float32)
    for i in range(nb):
        for j in range(kb):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float()
            amax = float(blk.abs().max())
            s[i, j] = amax / 448.0 if amax > 0 else 1.0
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (blk / s[i, j]).clamp(-448, 448).to(E4M3)
    return q, s


def _reference_dequantize(q, s):
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            out[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = \
                q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float() * s[i, j]
    return out


def _bits(t):
    return t.view(torch.uint8) if t.dtype == E4M3 else t


@pytest.mark.parametrize("shape", [(576, 300), (256, 128), (5, 7)])
def test_blocks_match_the_per_block_loop(shape):
    from megatron_glm5.fp8.blocks import dequantize_blocks, quantize_blocks

    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g) * torch.logspace(-3, 1, shape[1])  # blocks of very different ranges
    zero_block = shape[0] > 128
    if zero_block:
        w[:128, :128] = 0  # an all-zero block: scale 1, zeros
    q, s = quantize_blocks(w)
    rq, rs = _reference_quantize(w)
    assert q.dtype == E4M3 and s.dtype == torch.float32
    assert tuple(s.shape) == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    assert torch.equal(s, rs) and torch.equal(_bits(q), _bits(rq))
    if zero_block:
        assert s[0, 0] == 1.0 and not q[:128, :128].float().any()
    deq = dequantize_blocks(q, s, torch.float32)
    assert torch.equal(deq, _reference_dequantize(rq, rs))
    rel = ((deq - w).abs().amax() / w.abs().amax()).item()
    assert rel < 2 ** -4  # e4m3: 3 mantissa bits
    assert dequantize_blocks(q, s, torch.bfloat16).dtype == torch.bfloat16


def test_blocks_3d_experts_are_per_expert():
    from megatron_glm5.fp8.blocks import dequantize_blocks, quantize_blocks

    w = torch.randn(3, 200, 130, generator=torch.Generator().manual_seed(1))
    w[1] *= 100  # experts of different ranges get their own scales
    q, s = quantize_blocks(w)
    assert tuple(s.shape) == (3, 2, 2)
    for e in range(3):
        rq, rs = _reference_quantize(w[e])
        assert torch.equal(s[e], rs) and torch.equal(_bits(q[e]), _bits(rq))
    assert torch.equal(dequantize_blocks(q, s, torch.float32)[2], _reference_dequantize(*_reference_quantize(w[2])))
    with pytest.raises(ValueError, match="does not fit"):
        dequantize_blocks(q, s[:, :1], torch.float32)


def test_fp8_linear_forward_and_input_grad_equal_the_dequantised_weight():
    from megatron_glm5.fp8.matmul import fp8_grouped_linear, fp8_linear

    g = torch.Generator().manual_seed(2)
    w = torch.randn(300, 200, generator=g)
    q, s = _reference_quantize(w)
    wd = _reference_dequantize(q, s)
    x = torch.randn(2, 5, 200, generator=g, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y = fp8_linear(x, q, s)
    dy = torch.randn(y.shape, generator=g)
    y.backward(dy)
    y2 = x2 @ wd.t()
    y2.backward(dy)
    assert torch.allclose(y, y2, rtol=1e-6, atol=1e-5) and torch.allclose(x.grad, x2.grad, rtol=1e-6, atol=1e-5)
    assert not q.requires_grad and not s.requires_grad

    pairs = [_reference_quantize(torch.randn(140, 72, generator=g)) for _ in range(3)]
    qe, se = torch.stack([a for a, _ in pairs]), torch.stack([b for _, b in pairs])
    counts = [4, 0, 3]
    xe = torch.randn(7, 72, generator=g, requires_grad=True)
    ye = fp8_grouped_linear(xe, qe, se, torch.tensor(counts))
    dye = torch.randn(ye.shape, generator=g)
    ye.backward(dye)
    rows = torch.split(torch.arange(7), counts)
    for e, r in enumerate(rows):
        we = _reference_dequantize(qe[e], se[e])
        assert torch.allclose(ye[r], xe[r] @ we.t(), rtol=1e-6, atol=1e-5)
        assert torch.allclose(xe.grad[r], dye[r] @ we, rtol=1e-6, atol=1e-5)


# ============================================================================ the model
@pytest.fixture(scope="module")
def tiny_pair():
    """(fp8 model, fp32 model holding the fp8 model's dequantised weights), both from --seed 5."""
    from megatron_glm5.config import GLM5Config
    from megatron_glm5.model.init import initialize_by_global_identity
    from megatron_glm5.model.model import build_model

    cfg = GLM5Config.from_preset("tiny")
    m8 = build_model(cfg, mtp=True, base_precision="fp8")
    initialize_by_global_identity(m8, 5)
    m32 = build_model(cfg, mtp=True)
    initialize_by_global_identity(m32, 5)
    return cfg, m8, m32


def _dequantised(model8) -> dict:
    """name -> fp32 weight of every FP8 tensor of ``model8`` (gate|up halves each with their own block grid)."""
    out = {}
    params = dict(model8.named_parameters())
    for name, p in params.items():
        if p.dtype != E4M3:
            continue
        s = params[name + "_scale_inv"]
        if name.endswith("linear_fc1.weight") and ".experts." not in name:
            halves = [_reference_dequantize(h, hs) for h, hs in zip(p.chunk(2), s.chunk(2))]
            out[name] = torch.cat(halves)
        else:
            flat_q, flat_s = p.reshape(-1, *p.shape[-2:]), s.reshape(-1, *s.shape[-2:])
            out[name] = torch.stack([_reference_dequantize(a, b) for a, b in zip(flat_q, flat_s)]).view(p.shape)
    return out


def test_fp8_base_holds_the_release_matrices_frozen(tiny_pair):
    _, m8, _ = tiny_pair
    params = dict(m8.named_parameters())
    fp8 = sorted(k for k, p in params.items() if p.dtype == E4M3)
    layer0 = {k.split("decoder.layers.0.")[1] for k in fp8 if k.startswith("decoder.layers.0.")}
    assert layer0 == {"self_attention.linear_q_down_proj.weight", "self_attention.linear_q_up_proj.weight",
                      "self_attention.linear_kv_down_proj.weight", "self_attention.linear_kv_up_proj.weight",
                      "self_attention.linear_proj.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"}
    layer1 = {k.split("decoder.layers.1.")[1] for k in fp8 if k.startswith("decoder.layers.1.")}
    assert {"mlp.experts.weight1", "mlp.experts.weight2", "mlp.shared_experts.linear_fc1.weight",
            "mlp.shared_experts.linear_fc2.weight"} <= layer1
    assert not any(s in k for k in fp8 for s in ("router", "indexer", "embedding", "output_layer", "eh_proj",
                                                  "layernorm", "norm"))
    assert all(not params[k].requires_grad and not params[k + "_scale_inv"].requires_grad for k in fp8)
    assert params["decoder.layers.1.mlp.experts.weight1_scale_inv"].shape == (8, 2, 1, 1)


def test_fp8_model_equals_the_dequantised_fp32_model(tiny_pair):
    from megatron_glm5.fp8.blocks import quantize_blocks

    _, m8, m32 = tiny_pair
    p8, p32 = dict(m8.named_parameters()), dict(m32.named_parameters())
    # from scratch, the FP8 base is the fp32 model's init quantised (gate|up halves on their own)
    for name, p in p8.items():
        if name.endswith("_scale_inv"):
            continue
        if p.dtype != E4M3:
            assert torch.equal(p, p32[name]), name
        elif name.endswith("linear_fc1.weight") and ".experts." not in name:
            qs = [quantize_blocks(h) for h in p32[name].detach().chunk(2)]
            assert torch.equal(_bits(p), _bits(torch.cat([a for a, _ in qs]))), name
        else:
            assert torch.equal(_bits(p), _bits(quantize_blocks(p32[name].detach())[0])), name
    with torch.no_grad():
        for name, w in _dequantised(m8).items():
            p32[name].copy_(w)
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(3))
    labels = torch.roll(tokens, -1, 1)
    results = []
    for model in (m8, m32):
        model.zero_grad(set_to_none=True)
        logits = model(tokens)
        loss = model(tokens, labels=labels).float().mean()
        loss.backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        results.append((logits.detach(), grads))
    (l8, g8), (l32, g32) = results
    assert torch.allclose(l8, l32, rtol=1e-5, atol=1e-6)
    assert set(g8) and set(g8) <= set(g32) and not any(".experts.weight" in k for k in g8)
    for k in g8:
        assert torch.allclose(g8[k], g32[k], rtol=1e-4, atol=1e-7), k
    p32_grads_of_frozen = [k for k in g32 if k not in g8]
    assert all(p8[k].dtype == E4M3 for k in p32_grads_of_frozen)


def test_fp8_checkpoint_round_trip_is_bitwise(tiny_pair, tmp_path):
    import queue

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_glm5.model.model import build_model

    cfg, m8, _ = tiny_pair
    filesystem_async._results_queue = queue.Queue()  # in-process writer results (as training/checkpointing.py)
    (tmp_path / "ckpt").mkdir()
    dist_checkpointing.save(m8.sharded_state_dict(), str(tmp_path / "ckpt"))
    fresh = build_model(cfg, mtp=True, base_precision="fp8", perform_initialization=False)
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), str(tmp_path / "ckpt")), strict=False)
    a, b = m8.state_dict(), fresh.state_dict()
    tensors = [k for k in a if torch.is_tensor(a[k])]
    assert sum(a[k].dtype == E4M3 for k in tensors) == 43
    for k in tensors:
        assert a[k].dtype == b[k].dtype and torch.equal(_bits(a[k]), _bits(b[k])), k


# ============================================================================ conversion
def _fp8_release(cfg, model32, directory):
    """A tiny GLM-5-FP8-style HF directory from our fp32 model: every release-FP8 matrix quantised here."""
    from megatron_glm5.conversion.fp8_io import QUANTIZATION_CONFIG, is_fp8_weight
    from megatron_glm5.conversion.hf_mapping import mcore_to_hf

    state = {k: v for k, v in model32.state_dict().items() if torch.is_tensor(v)}
    hf = {k: v.detach().contiguous() for k, v in mcore_to_hf(state, cfg).items()}
    out = {}
    for k, v in hf.items():
        if is_fp8_weight(k):
            q, s = _reference_quantize(v)
            out[k], out[k[:-len("weight")] + "weight_scale_inv"] = q, s
        else:
            out[k] = v.clone()  # the MTP copies of the embedding and head share memory
    os.makedirs(directory)
    save_file(out, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    hf_config = dict(cfg.to_hf(), quantization_config=QUANTIZATION_CONFIG)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_config, f)
    return out


def _read_dir(directory) -> dict:
    reader = HFCheckpointReader(str(directory))
    return {k: reader.get(k) for k in reader.keys()}


@pytest.fixture(scope="module")
def release(tiny_pair, tmp_path_factory):
    """(directory, HF tensors) of a tiny FP8 release, converted with --keep-fp8 into <directory>/ckpt8."""
    from megatron_glm5.conversion.convert import convert_hf_to_megatron

    cfg, _, m32 = tiny_pair
    root = tmp_path_factory.mktemp("fp8")
    source = _fp8_release(cfg, m32, str(root / "release"))
    convert_hf_to_megatron(str(root / "release"), str(root / "ckpt8"), keep_fp8=True, progress=False)
    return root, source


def test_keep_fp8_import_and_export_are_bitwise(release):
    from megatron_glm5.conversion.convert import convert_megatron_to_hf
    from megatron_glm5.conversion.torch_dist_stream import TorchDistReader
    from megatron_glm5.fp8.flags import checkpoint_base_precision

    root, source = release
    assert checkpoint_base_precision(str(root / "ckpt8")) == "fp8"
    reader = TorchDistReader(str(root / "ckpt8"))
    q = reader.read_region("decoder.layers.0.self_attention.linear_kv_down_proj.weight", (0, 0), (24, 64))
    assert q.dtype == E4M3
    assert torch.equal(_bits(q), _bits(source["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]))
    w1s = reader.read_region("decoder.layers.1.mlp.experts.weight1_scale_inv", (3, 1, 0, 0), (1, 1, 1, 1))
    assert torch.equal(w1s.view(1, 1), source["model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"])
    reader.close()

    convert_megatron_to_hf(str(root / "ckpt8"), str(root / "out8"), progress=False)
    out = _read_dir(root / "out8")
    assert set(out) == set(source)
    requantised = {k for k in source if ".indexer.wq_b." in k or ".indexer.wk." in k}  # bf16 in our model
    assert requantised and all(".weight" in k for k in requantised)
    for k, v in source.items():
        assert out[k].dtype == v.dtype, k
        if k not in requantised:
            assert torch.equal(_bits(out[k]), _bits(v)), k
    with open(root / "out8" / "config.json") as f:
        qc = json.load(f)["quantization_config"]
    # the release's form: full names per layer (tiny: layer 0 dense, 1-3 MoE, every layer a full indexer, MTP = 4)
    indexer = [f"model.layers.{i}.self_attn.{m}" for i in range(5) for m in ("indexer.weights_proj", "indexers_proj")]
    expected = {"model.embed_tokens", "lm_head", *indexer, *(f"model.layers.{i}.mlp.gate" for i in (1, 2, 3, 4)),
                *(f"model.layers.4.{m}" for m in ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head.norm",
                                                  "shared_head.head"))}
    not_convert = qc.pop("modules_to_not_convert")
    assert len(not_convert) == len(expected) and set(not_convert) == expected
    assert qc == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                  "weight_block_size": [128, 128]}
    # no listed name is a substring of an FP8 module's name (loaders that match substrings keep them FP8)
    fp8_modules = {k[:-len(".weight")] for k, v in out.items() if v.dtype == E4M3}
    assert fp8_modules and not [(n, m) for n in not_convert for m in fp8_modules if n in m]
    # and every high-precision matrix of the export is listed by its own name
    kept = {k[:-len(".weight")] for k, v in out.items() if v.dim() == 2 and v.dtype != E4M3
            and not k.endswith("_scale_inv")}
    assert kept <= set(not_convert), kept - set(not_convert)

    convert_megatron_to_hf(str(root / "ckpt8"), str(root / "out32"), dtype="fp32", progress=False)
    deq = _read_dir(root / "out32")
    k = "model.layers.1.mlp.experts.5.down_proj.weight"
    assert "model.layers.1.mlp.experts.5.down_proj.weight_scale_inv" not in deq
    assert torch.equal(deq[k], _reference_dequantize(source[k], source[k[:-6] + "weight_scale_inv"]))


def test_fp8_export_loads_in_transformers(release):
    pytest.importorskip("accelerate")  # transformers' FP8 loader needs it
    from transformers import AutoModelForCausalLM

    from megatron_glm5.conversion.convert import convert_megatron_to_hf

    root, _ = release
    convert_megatron_to_hf(str(root / "ckpt8"), str(root / "hf_bf16"), dtype="bf16", mtp=False, progress=False)
    convert_megatron_to_hf(str(root / "ckpt8"), str(root / "hf_fp8"), dtype="fp8", mtp=False, progress=False)
    tokens = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(4))
    logits = []
    for d in ("hf_bf16", "hf_fp8"):
        model = AutoModelForCausalLM.from_pretrained(str(root / d), dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(model(tokens).logits)
    rel = ((logits[0] - logits[1]).norm() / logits[0].norm()).item()
    assert rel < 2e-2, rel


def test_bad_input_lines(release, tmp_path, monkeypatch):
    import argparse

    from megatron_glm5.config import GLM5Config
    from megatron_glm5.conversion.convert import ConversionError, convert_hf_to_megatron
    from megatron_glm5.fp8 import flags

    root, _ = release
    cfg = GLM5Config.from_preset("tiny")
    args = argparse.Namespace(base_precision="fp8", load=None, lora_rank=None, eval_only=False, dsa_stage="sparse",
                              tensor_model_parallel_size=1, expert_tensor_parallel_size=None)
    with pytest.raises(flags.FP8FlagError, match="--lora-rank N to train adapters on it, or use it with --eval-only"):
        flags.check(args, cfg, cuda=False)
    args.lora_rank = 8
    assert flags.check(args, cfg, cuda=False) == {}
    monkeypatch.setattr(flags, "_gpu_capability", lambda: ((8, 0), "NVIDIA A100"))
    with pytest.raises(flags.FP8FlagError, match=r"compute capability 8.9 or newer.*A100 is 8.0"):
        flags.check(args, cfg, cuda=True)
    big = GLM5Config.from_preset("glm5")
    args.tensor_model_parallel_size = 8
    monkeypatch.setattr(flags, "_gpu_capability", lambda: ((9, 0), "NVIDIA H200"))
    assert flags.check(args, big, cuda=True) == {}  # every full-width shard cuts on 128 (kv_a is held whole)
    args.tensor_model_parallel_size = 128
    with pytest.raises(flags.FP8FlagError,
                       match=r"--tp 128 splits mlp.gate_proj/up_proj \(dense layers\)'s 12288 rows into 96 per rank"):
        flags.check(args, big, cuda=False)
    args.tensor_model_parallel_size = 1
    args.load = str(root / "ckpt8")
    args.base_precision = "bf16"
    with pytest.raises(flags.FP8FlagError, match="holds an FP8 base.*pass --base-precision fp8"):
        flags.check(args, cfg, cuda=False)
    bf16 = tmp_path / "ckpt16"
    convert_hf_to_megatron(str(root / "release"), str(bf16), progress=False)  # dequantised: a bf16 base
    args.base_precision, args.load = "fp8", str(bf16)
    with pytest.raises(flags.FP8FlagError, match="holds a bf16 base.*--keep-fp8"):
        flags.check(args, cfg, cuda=False)
    with pytest.raises(ConversionError, match="--dtype fp8 is for the export"):
        convert_hf_to_megatron(str(root / "release"), str(tmp_path / "x"), dtype="fp8", progress=False)


# ============================================================================ tensor and expert parallel
def _layout_worker(ckpt: str, out_dir: str) -> None:
    """torchrun worker: the --keep-fp8 checkpoint at TP2 (shards of whole blocks, small weights held whole) and at
    EP2 (experts' FP8 tensors and scales split by expert); writes the full logits of a prompt."""
    import torch.distributed as dist

    import megatron_glm5  # noqa: F401  (CPU shims before megatron-core is imported)
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from megatron_glm5 import platform
    from megatron_glm5.config import GLM5Config
    from megatron_glm5.model.model import build_model

    cfg = GLM5Config.from_preset("tiny")
    ids = torch.load(os.path.join(out_dir, "ids.pt"))
    for name, tp, ep in (("tp2", 2, 1), ("ep2", 1, 2)):
        platform.initialize_model_parallel(tp=tp, ep=ep, etp=1)
        model = build_model(cfg, mtp=True, base_precision="fp8", perform_initialization=False,
                            tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                            expert_tensor_parallel_size=1, sequence_parallel=False)
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), ckpt), strict=False)
        with torch.no_grad():
            logits = model.eval()(ids)
        if logits.shape[-1] != cfg.vocab_size:  # vocab-parallel output
            parts = [torch.empty_like(logits) for _ in range(tp)]
            dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
            logits = torch.cat(parts, -1)
        if dist.get_rank() == 0:
            torch.save(logits, os.path.join(out_dir, f"logits_{name}.pt"))
        print(f"{name} rank {dist.get_rank()} done", flush=True)
    platform.end_of_job()


@pytest.mark.distributed
def test_fp8_base_at_tp2_and_ep2_equals_one_process(release, tmp_path):
    import subprocess
    import sys

    from megatron.core import dist_checkpointing

    from megatron_glm5 import platform
    from megatron_glm5.config import GLM5Config
    from megatron_glm5.model.model import build_model

    root, _ = release
    ckpt = str(root / "ckpt8")
    platform.initialize_model_parallel()
    model = build_model(GLM5Config.from_preset("tiny"), mtp=True, base_precision="fp8", perform_initialization=False)
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), ckpt), strict=False)
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(6))
    torch.save(ids, tmp_path / "ids.pt")
    with torch.no_grad():
        expected = model.eval()(ids)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           os.path.abspath(__file__), ckpt, str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for name in ("tp2", "ep2"):
        got = torch.load(tmp_path / f"logits_{name}.pt")
        assert ((got - expected).norm() / expected.norm()).item() < 1e-5, name


if __name__ == "__main__":  # torchrun worker of test_fp8_base_at_tp2_and_ep2_equals_one_process
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    import sys

    _layout_worker(sys.argv[1], sys.argv[2])


def test_merge_lora_into_the_fp8_base_end_to_end(release, tmp_path):
    """finetune_glm5.py trains rank-4 adapters on the --keep-fp8 checkpoint (--base-precision fp8); then
    convert_megatron_to_hf --merge-lora writes (auto) the release's FP8 layout again: the adapted matrices
    re-quantised from dequant(base) + (alpha/r) B A (compared here against that sum, written out from the two
    checkpoints), every other FP8 matrix and its scales as imported (bitwise); --dtype bf16 writes the merged bf16."""
    from megatron.core.dist_checkpointing import load_tensors_metadata
    from training_helpers import check_ok, run_entry

    from megatron_glm5.conversion.convert import convert_megatron_to_hf
    from megatron_glm5.conversion.torch_dist_stream import TorchDistReader
    from megatron_glm5.lora.export import merge_into

    root, source = release
    check_ok(run_entry("finetune", ["--load", str(root / "ckpt8"), "--finetune", "--base-precision", "fp8",
                                    "--lora-rank", "4", "--lora-alpha", "8", "--lora-target-modules", "kv_b",
                                    "--lr", "5e-2", "--train-iters", "2", "--eval-iters", "0", "--no-mtp",
                                    "--save", "A"], tmp_path))
    adapters = TorchDistReader(str(tmp_path / "A" / "iter_0000002"))
    a_key = next(k for k in adapters.tensor_keys() if k.endswith("layers.0.self_attention.linear_kv_up_proj.lora_a"))
    a = adapters.read_region(a_key, (0, 0), adapters.shape(a_key)).float()
    b_key = a_key[:-1] + "b"
    b = adapters.read_region(b_key, (0, 0), adapters.shape(b_key)).float()
    assert b.abs().max() > 0  # trained: B left its zero start
    merged_name = "model.layers.0.self_attn.kv_b_proj.weight"
    want = _reference_dequantize(source[merged_name], source[merged_name + "_scale_inv"]) + 2.0 * b @ a

    convert_megatron_to_hf(str(root / "ckpt8"), str(tmp_path / "fp8"), mtp=False, progress=False,
                           wrap_reader=merge_into(str(tmp_path / "A")))
    out = _read_dir(tmp_path / "fp8")
    assert out[merged_name].dtype == E4M3
    got = _reference_dequantize(out[merged_name], out[merged_name + "_scale_inv"])
    assert float((got - want).norm() / want.norm()) < 0.05  # e4m3 rounding of the merged weight
    assert not torch.equal(_bits(out[merged_name]), _bits(source[merged_name]))
    # everything else as imported (the indexer's wq_b / wk excepted: our model keeps them in bf16, the export
    # quantises them again, docs/fp8.md)
    others = [k for k in source if k in out and ".kv_b_proj." not in k and ".indexer.w" not in k]
    assert len(others) > 20
    for k in others:
        assert torch.equal(_bits(out[k]), _bits(source[k])), k

    convert_megatron_to_hf(str(root / "ckpt8"), str(tmp_path / "bf16"), dtype="bf16", mtp=False, progress=False,
                           wrap_reader=merge_into(str(tmp_path / "A")))
    bf = _read_dir(tmp_path / "bf16")[merged_name]
    assert bf.dtype == torch.bfloat16 and torch.allclose(bf.float(), want, rtol=2 ** -7, atol=1e-6)
