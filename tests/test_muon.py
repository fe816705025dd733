"""--optimizer muon (training/muon.py, training/muon_setup.py; docs/muon.md).

- the update of every Muon parameter of the tiny model equals a plain reference written here: Newton-Schulz (the
  quintic with Keller Jordan's coefficients) on each head block / expert / whole matrix of the gradient, times
  sqrt(max(rows, cols)), to fp32 rounding; which parameters Muon holds (2-D matrices and the grouped experts) and
  which Adam holds (embedding, output head, norms, 1-D);
- the flags' one-line refusals; the planner's optimizer-state bytes for Muon (one fp32 momentum buffer per matrix
  element, Adam's two moments for the rest), hand-computed.
Layouts and the bitwise resume: tests/test_muon_layouts.py.
"""
from __future__ import annotations

import pytest
import torch

import megatron_glm5
from megatron_glm5.arguments import parse_args, validate_args

A, B, C = 3.4445, -4.7750, 2.0315
LR = 0.02


def _ns(m: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Newton-Schulz on one matrix, written out (the reference)."""
    x = m.float()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        g = x @ x.T
        x = A * x + (B * g + C * g @ g) @ x
    return x.T if tall else x


def _whole(g):
    return _ns(g) * max(g.shape) ** 0.5


def _row_blocks(g, size):
    return torch.cat([_whole(g[i:i + size]) for i in range(0, g.shape[0], size)], dim=0)


def _col_blocks(g, size):
    return torch.cat([_whole(g[:, i:i + size]) for i in range(0, g.shape[1], size)], dim=1)


def _build(extra=()):
    from megatron_glm5.training.loop import build_model_chunks, wrap_ddp
    from megatron_glm5.training.optim import build_optimizer

    args = validate_args(parse_args(["--preset", "tiny", "--attn", "torch", "--optimizer", "muon", "--no-save",
                                     "--weight-decay", "0", *extra], mode="finetune"), world_size=1)
    megatron_glm5.initialize_model_parallel(seed=5)
    chunks = wrap_ddp(args, build_model_chunks(args))
    return args, chunks, build_optimizer(args, chunks)


def _muon_params(optimizer):
    from megatron_glm5.training.muon import GLM5Muon
    from megatron_glm5.training.muon_setup import leaf_optimizers

    muon, adam = set(), set()
    for opt in leaf_optimizers(optimizer):
        for group in opt.optimizer.param_groups:
            (muon if isinstance(opt.optimizer, GLM5Muon) else adam).update(id(p) for p in group["params"])
    return muon, adam


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("bf16", [False, pytest.param(True, marks=[pytest.mark.gpu, GPU])], ids=["fp32", "bf16"])
def test_per_head_update_equals_the_reference(bf16):
    """bf16 (GPU): megatron-core steps fp32 main copies of the bf16 weights; the split must reach them too."""
    args, chunks, optimizer = _build(["--bf16"] if bf16 else [])
    cfg = chunks[0].config
    named = dict(chunks[0].module.named_parameters())
    muon_ids, adam_ids = _muon_params(optimizer)
    main = {id(getattr(p, "main_param", p)): id(p) for p in named.values()}  # optimizer's tensor -> model's
    muon, adam = {main[i] for i in muon_ids}, {main[i] for i in adam_ids}
    expect_adam = {n for n, p in named.items()
                   if p.dim() == 1 or "embedding" in n or n.startswith("output_layer")}
    assert {n for n, p in named.items() if id(p) in adam} == expect_adam
    assert {n for n, p in named.items() if id(p) in muon} == set(named) - expect_adam
    assert any(n.endswith("experts.weight1") for n in named if id(named[n]) in muon)

    gen = torch.Generator().manual_seed(0)
    weights = {n: getattr(p, "main_param", p) for n, p in named.items()}  # fp32 (bf16: the main copies)
    before = {n: w.detach().clone() for n, w in weights.items()}
    grads = {n: torch.randn(p.shape, generator=gen).to(p.device) for n, p in named.items()}
    for n, p in named.items():
        p.main_grad.copy_(grads[n])
    for g in optimizer.param_groups:
        g["lr"] = LR
    ok, _, _ = optimizer.step()
    assert ok

    heads = 0
    for n, p in named.items():
        if id(p) not in muon:
            continue
        g = grads[n]
        if n.endswith(("linear_q_up_proj.weight", "linear_q_proj.weight")):
            ref = _row_blocks(g, cfg.qk_head_dim + cfg.qk_pos_emb_head_dim)
            heads += 1
        elif n.endswith("linear_kv_up_proj.weight"):
            ref = _row_blocks(g, cfg.qk_head_dim + cfg.v_head_dim)
            heads += 1
        elif n.endswith("self_attention.linear_proj.weight"):
            ref = _col_blocks(g, cfg.v_head_dim)
            heads += 1
        elif n.endswith("indexer.linear_wq_b.weight"):
            ref = _row_blocks(g, cfg.dsa_index_head_dim)
            heads += 1
        elif n.endswith("experts.weight1"):  # [E, 2, I, H]: [gate; up] of each expert as one matrix
            ref = torch.stack([_whole(e.reshape(-1, e.shape[-1])) for e in g]).reshape(g.shape)
        elif n.endswith("experts.weight2"):
            ref = torch.stack([_whole(e) for e in g])
        else:
            assert p.dim() == 2, n
            ref = _whole(g)
        # the first step's Nesterov momentum is a multiple of the gradient: Newton-Schulz normalises it away;
        # updates are up to ~0.1: 1e-5 is 1e-4 of that (fp32 Newton-Schulz, batched vs one matrix at a time)
        torch.testing.assert_close(weights[n].detach() - before[n], -LR * ref, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, n=n: f"{n}: {m}")
    assert heads >= 4 * 3  # every layer's q_up, kv_up and output projection were split
    # a split block is not the whole-matrix orthogonalisation (the check above can fail)
    n = next(n for n in named if n.endswith("linear_kv_up_proj.weight"))
    assert not torch.allclose(-LR * _whole(grads[n]), weights[n].detach() - before[n], atol=1e-4)


def test_no_split_heads_orthogonalises_whole_matrices():
    _, chunks, optimizer = _build(["--no-muon-split-heads"])
    named = dict(chunks[0].module.named_parameters())
    n = next(n for n in named if n.endswith("linear_kv_up_proj.weight"))
    gen = torch.Generator().manual_seed(1)
    before = {k: p.detach().clone() for k, p in named.items()}
    for p in named.values():
        p.main_grad.copy_(torch.randn(p.shape, generator=gen))
    g = named[n].main_grad.clone()
    for group in optimizer.param_groups:
        group["lr"] = LR
    optimizer.step()
    torch.testing.assert_close(named[n].detach() - before[n], -LR * _whole(g), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("argv, match", [
    (["--muon-momentum", "1.0"], "--muon-momentum 1 must be in"),
    (["--muon-ns-steps", "0"], "--muon-ns-steps 0 must be at least 1"),
    (["--muon-matched-adamw-rms", "0.2", "--muon-scale-mode", "shape_scaling"], "drop --muon-scale-mode"),
])
def test_bad_muon_flags_are_refused(argv, match):
    from megatron_glm5.errors import UserError

    with pytest.raises(UserError, match=match):
        validate_args(parse_args(["--preset", "tiny", "--optimizer", "muon", "--no-save", *argv],
                                 mode="finetune"), world_size=1)


def test_planner_counts_one_momentum_buffer_per_muon_element():
    from megatron_glm5.planning.buffers import Buffer, buffer_layout, static_memory
    from megatron_glm5.planning.inventory import Tensor

    dense = [Tensor("embedding.word_embeddings.weight", 50, "embedding"),
             Tensor("decoder.layers.0.input_layernorm.weight", 10, "dense"),
             Tensor("decoder.layers.0.self_attention.linear_proj.weight", 100, "dense"),
             Tensor("decoder.layers.0.self_attention.core_attention.indexer.k_norm.bias", 6, "dense")]
    experts = [Tensor("decoder.layers.0.mlp.experts.weight1", 40, "experts", expert=True)]
    bufs = [Buffer(0, False, buffer_layout(dense, None, 1, False), 1),
            Buffer(0, True, buffer_layout(experts, None, 1, False), 1)]

    def moments(optimizer, bf16=False):
        st = static_memory(bufs, dense_index=0, expert_index=0, bf16=bf16, distributed_optimizer=False,
                           optimizer=optimizer)
        return st.optimizer_moment_bytes, st.optimizer_main_bytes

    # Muon: linear_proj 100 + experts 40 elements x 4 bytes; embedding 50, norm 10, bias 6 x 8 bytes (Adam)
    assert moments("muon") == (140 * 4 + 66 * 8, 0)
    assert moments("adam") == (206 * 8, 0)
    assert moments("muon", bf16=True) == (140 * 4 + 66 * 8, 206 * 4)


@pytest.mark.parametrize("saved, now, ok", [
    (None, ["--optimizer", "adam"], True),  # a checkpoint from before the record: Adam's
    (None, ["--optimizer", "muon"], False),
    ({"optimizer": "muon", "layer_wise": False}, ["--optimizer", "adam", "--use-distributed-optimizer"], False),
    ({"optimizer": "muon", "layer_wise": False}, ["--optimizer", "muon"], True),
    ({"optimizer": "muon", "layer_wise": True}, ["--optimizer", "muon"], False),
    ({"optimizer": "adam", "layer_wise": False}, ["--optimizer", "adam", "--use-distributed-optimizer"], True),
])
def test_resume_refuses_another_optimizers_state(saved, now, ok):
    from megatron_glm5.training.muon_flags import OptimizerStateMismatch, check_resume

    args = parse_args(["--preset", "tiny", "--no-save", *now], mode="finetune")
    if ok:
        check_resume(saved, args, "ck/iter_0000003")
    else:
        with pytest.raises(OptimizerStateMismatch, match=r"^--load ck/iter_0000003: its optimizer state was written "
                                                          r"by --optimizer .*--no-load-optim"):
            check_resume(saved, args, "ck/iter_0000003")
