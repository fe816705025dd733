"""LoRA adapters on our model (in process, CPU fp32, the tiny preset) against transformers + peft:

- a PEFT directory written from our adapters (lora/export.py's table: attention as target_modules, the routed
  experts as 3-D target_parameters) loads with ``PeftModel.from_pretrained`` onto GlmMoeDsaForCausalLM, and its
  logits equal ours within 1e-5 relative;
- training the adapters on one batch lowers its loss; the backward gives gradients to the adapters only (the frozen
  base gets none), the optimizer holds only them, and every base tensor stays bitwise as it was;
- the merged weights (lora/export.MergingReader) equal base + (alpha/r) B A computed here.
"""
from __future__ import annotations

import json

import pytest
import torch

import megatron_glm5
from hf_tiny import make_hf_model, save_hf_model

peft = pytest.importorskip("peft", reason="pip install peft (the test extra)")

SEQ, BATCH = 24, 2


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    from megatron_glm5.lora.apply import apply_lora
    from megatron_glm5.lora.config import LoRAConfig
    from megatron_glm5.lora import targets

    hf, cfg = make_hf_model("tiny", seed=3)
    path = save_hf_model(hf, tmp_path_factory.mktemp("hf"))
    ours = megatron_glm5.from_hf_pretrained(path, dsa_backend="torch", device="cpu")
    lora = LoRAConfig(rank=4, alpha=6.0, dropout=0.0, targets=targets.resolve(["attention", "experts"]))
    apply_lora(ours, lora, seed=11)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.rsplit(".", 1)[-1].startswith("lora_b"):  # B starts at zero: give the adapters an effect
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return hf, ours, cfg, lora, path


def _adapters(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if n.rsplit(".", 1)[-1].startswith("lora_")}


def test_peft_export_loads_with_equal_logits(adapted, tmp_path):
    from safetensors.torch import save_file
    from transformers import GlmMoeDsaForCausalLM

    from megatron_glm5.lora.export import peft_state

    hf, ours, cfg, lora, path = adapted
    state, modules, params = peft_state(cfg, lora, _adapters(ours))
    assert len(modules) == 5 * cfg.num_hidden_layers and len(params) == 2 * (cfg.num_hidden_layers - 1)
    save_file(state, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": 0.0,
        "target_modules": modules, "target_parameters": params, "bias": "none"}))
    base = GlmMoeDsaForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="eager").eval()
    model = peft.PeftModel.from_pretrained(base, str(tmp_path)).eval()
    loaded = peft.get_peft_model_state_dict(model)
    assert set(loaded) == set(state) and all(torch.equal(loaded[k], state[k]) for k in state)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        out = ours.eval()(ids)
    out = out.transpose(0, 1) if out.shape[0] != BATCH else out
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel < 1e-5, rel
    with model.disable_adapter(), torch.no_grad():  # the adapters really change the logits
        off = model(input_ids=ids).logits
    assert ((off - ref).norm() / ref.norm()).item() > 1e-3


def test_only_adapters_get_gradients_and_the_base_stays_bitwise(adapted):
    hf, ours, cfg, lora, path = adapted
    base_before = {n: p.detach().clone() for n, p in ours.named_parameters() if not p.requires_grad}
    trainable = [p for p in ours.parameters() if p.requires_grad]
    names = [n for n, p in ours.named_parameters() if p.requires_grad]
    assert names and all(n.rsplit(".", 1)[-1].startswith("lora_") for n in names)
    opt = torch.optim.Adam(trainable, lr=1e-2)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    ours.train()
    losses = []
    for _ in range(6):  # the same batch: the adapters alone must bring its loss down
        opt.zero_grad()
        loss = ours(ids, labels=ids).float().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    ours.eval()
    assert losses[-1] < losses[0] - 0.05, losses
    assert all(p.grad is None for n, p in ours.named_parameters() if not p.requires_grad)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable)
    assert set(id(p) for p in opt.state) == set(id(p) for p in trainable)
    for n, p in ours.named_parameters():
        if n in base_before:
            assert torch.equal(p, base_before[n]), n


class _MemoryReader:
    """A reader over in-memory tensors with TorchDistReader's interface (MergingReader reads blocks through it)."""

    def __init__(self, sd):
        self.sd = sd

    def __contains__(self, key):
        return key in self.sd

    def tensor_keys(self):
        return list(self.sd)

    def dtype(self, key):
        return self.sd[key].dtype

    def shape(self, key):
        return tuple(self.sd[key].shape)

    def read_region(self, key, offsets, sizes):
        return self.sd[key][tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].clone()


def _dequantized(q, s, groups=1):
    """q * scale_inv with every element's own 128x128 block scale, written out element by element's block index."""
    *lead, n, k = q.shape
    per = n // groups
    rows = torch.arange(n)
    block_row = (rows // per) * ((per + 127) // 128) + (rows % per) // 128
    block_col = torch.arange(k) // 128
    return q.float() * s[..., block_row[:, None], block_col[None, :]]


def _bf16_close(got, want):
    """``got`` is ``want`` rounded once to bf16 (one bf16 step apart at most: the product B A is summed in
    another order for a region than for the whole matrix); a wrong scale block or offset is off by far more."""
    return torch.allclose(got.float(), want, rtol=2 ** -7, atol=1e-6)


def test_merging_reader_on_an_fp8_base_dequantises_then_adds(adapted):
    """An FP8 base (the e4m3 values and block scales of quantize_blocks) merged: every adapted weight reads as
    dequant(q, s) + (alpha/r) B A in bf16, also for regions that start and end inside a 128 block, for an expert
    weight1 [E, 2, I, H], and for a gated fc1 whose gate and up halves have block grids of their own; their scales
    are no longer listed and the weights read as bf16, so the exporter quantises the merged weights again."""
    from megatron_glm5.fp8.blocks import BLOCK, quantize_blocks
    from megatron_glm5.lora.export import MergingReader

    hf, ours, cfg, lora, path = adapted
    adapters = _adapters(ours)
    g = torch.Generator().manual_seed(9)
    key, m = "decoder.layers.1.self_attention.linear_kv_up_proj.weight", "decoder.layers.1.self_attention.linear_kv_up_proj."
    ek, e = "decoder.layers.2.mlp.experts.weight1", "decoder.layers.2.mlp.experts."
    n, k = adapters[m + "lora_b"].shape[0], adapters[m + "lora_a"].shape[1]
    big = torch.randn(n + 300, k + 200, generator=g)  # a weight of several blocks in each direction
    sd = {}
    q, s = quantize_blocks(big)
    sd["big.weight"], sd["big.weight" + "_scale_inv"] = q, s
    r = 4
    big_adapters = {"big.lora_a": torch.randn(r, big.shape[1], generator=g),
                    "big.lora_b": torch.randn(big.shape[0], r, generator=g)}
    w1 = ours.state_dict()[ek].detach()
    sd[ek], sd[ek + "_scale_inv"] = quantize_blocks(w1.view(-1, *w1.shape[2:]))  # per (expert, gate/up) grid
    sd[ek] = sd[ek].view(w1.shape)
    sd[ek + "_scale_inv"] = sd[ek + "_scale_inv"].view(*w1.shape[:2], *sd[ek + "_scale_inv"].shape[1:])
    gate_up = torch.randn(2 * 200, 300, generator=g)  # a gated fc1: [gate; up], each 200 rows with its own grid
    qg, sg = zip(*(quantize_blocks(h) for h in gate_up.split(200)))
    sd["mlp.linear_fc1.weight"], sd["mlp.linear_fc1.weight_scale_inv"] = torch.cat(qg), torch.cat(sg)
    gated_adapters = {"mlp.linear_fc1.lora_a": torch.randn(r, 300, generator=g), "mlp.linear_fc1.lora_b": torch.randn(400, r, generator=g)}
    sd["plain.weight"] = torch.randn(8, 8, generator=g)  # not adapted, not FP8: read as stored
    merged = MergingReader(_MemoryReader(sd), {**adapters, **big_adapters, **gated_adapters}, lora)

    scaling = lora.alpha / lora.rank
    want = _dequantized(q, s) + scaling * big_adapters["big.lora_b"] @ big_adapters["big.lora_a"]
    for off, size in (((0, 0), tuple(big.shape)), ((130, 70), (200, 129)), ((255, 383), (3, 2))):
        got = merged.read_region("big.weight", off, size)
        assert got.dtype == torch.bfloat16
        sl = tuple(slice(o, o + z) for o, z in zip(off, size))
        assert _bf16_close(got, want[sl]), off
    d = torch.einsum("eor,erh->eoh", adapters[e + "lora_b1"], adapters[e + "lora_a1"]) * scaling
    want = _dequantized(sd[ek], sd[ek + "_scale_inv"]) + d.view(w1.shape)
    got = merged.read_region(ek, (2, 1, 0, 3), (3, 1, w1.shape[2], 4))
    assert got.dtype == torch.bfloat16 and _bf16_close(got, want[2:5, 1:2, :, 3:7])
    want = _dequantized(sd["mlp.linear_fc1.weight"], sd["mlp.linear_fc1.weight_scale_inv"], groups=2) + \
        scaling * gated_adapters["mlp.linear_fc1.lora_b"] @ gated_adapters["mlp.linear_fc1.lora_a"]
    assert BLOCK == 128 and sd["mlp.linear_fc1.weight_scale_inv"].shape[0] == 4  # 2 x ceil(200 / 128), not ceil(400 / 128)
    for off, size in (((0, 0), (200, 300)), ((200, 0), (200, 300)), ((330, 129), (40, 100))):
        sl = tuple(slice(o, o + z) for o, z in zip(off, size))
        assert _bf16_close(merged.read_region("mlp.linear_fc1.weight", off, size), want[sl]), off
    assert merged.dtype("big.weight") == merged.dtype(ek) == torch.bfloat16
    keys = merged.tensor_keys()
    assert "big.weight_scale_inv" not in keys and "mlp.linear_fc1.weight_scale_inv" not in keys and "big.weight" in keys
    assert "big.weight_scale_inv" not in merged
    assert torch.equal(merged.read_region("plain.weight", (1, 2), (3, 4)), sd["plain.weight"][1:4, 2:6])
    assert merged.dtype("plain.weight") == torch.float32


def test_merging_reader_adds_scaled_product(adapted):
    from megatron_glm5.lora.export import MergingReader

    hf, ours, cfg, lora, path = adapted
    adapters = _adapters(ours)
    sd = {k: v.detach() for k, v in ours.state_dict().items() if not k.endswith("_extra_state")}

    merged = MergingReader(_MemoryReader(sd), adapters, lora)
    key = "decoder.layers.1.self_attention.linear_kv_up_proj.weight"
    m = "decoder.layers.1.self_attention.linear_kv_up_proj."
    want = sd[key] + (lora.alpha / lora.rank) * adapters[m + "lora_b"] @ adapters[m + "lora_a"]
    got = merged.read_region(key, (3, 2), (5, 7))
    assert torch.allclose(got, want[3:8, 2:9], rtol=1e-6, atol=1e-7)
    ek, e = "decoder.layers.2.mlp.experts.weight1", "decoder.layers.2.mlp.experts."
    w1 = sd[ek]  # [E, 2, I, H]
    d = torch.einsum("eor,erh->eoh", adapters[e + "lora_b1"], adapters[e + "lora_a1"]) * (lora.alpha / lora.rank)
    want = w1 + d.view(w1.shape)
    got = merged.read_region(ek, (2, 1, 0, 3), (3, 1, w1.shape[2], 4))
    assert torch.allclose(got, want[2:5, 1:2, :, 3:7], rtol=1e-6, atol=1e-7)
