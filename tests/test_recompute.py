"""Full activation recomputation (uniform and block) gives the same loss and gradients as none, DSA and MTP
included (the per-forward AttentionInputs travel through the recomputed closures)."""
import pytest
import torch

import megatron_glm5
from megatron_glm5 import GLM5Config, build_model


def _loss_and_grads(**recompute):
    megatron_glm5.initialize_model_parallel(seed=11)
    model = build_model(GLM5Config.from_preset("tiny-indexshare"), dsa_indexer_loss_coeff=0.1, **recompute).train()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (2, 41), generator=g).to(model.output_layer.weight.device)
    loss = model(ids[:, :-1], labels=ids[:, 1:]).float().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("recompute", [
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=3),
    dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp", "shared_experts"]),
])
def test_full_recompute_matches(recompute):
    ref_loss, ref = _loss_and_grads()
    loss, grads = _loss_and_grads(**recompute)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref.keys()
    assert any(".indexer." in n for n in grads) and any(n.startswith("mtp.") for n in grads)
    for n in ref:
        # CPU: same up to reassociation; CUDA's embedding / index_add backward use atomics (order varies)
        tol = dict(rtol=1e-5, atol=1e-8) if ref[n].is_cuda else dict(rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(grads[n], ref[n], msg=n, **tol)


def test_unsupported_selective_module_is_refused():
    megatron_glm5.initialize_model_parallel()
    with pytest.raises(ValueError, match="mla_up_proj"):
        build_model(GLM5Config.from_preset("tiny"), recompute_granularity="selective", recompute_modules=["mla_up_proj"])


def test_layernorm_recompute_without_te_is_refused():
    try:
        import transformer_engine  # noqa: F401
        pytest.skip("Transformer Engine installed: megatron-core's layernorm recompute works")
    except ImportError:
        pass
    megatron_glm5.initialize_model_parallel()
    with pytest.raises(ValueError, match="layernorm needs Transformer Engine"):
        build_model(GLM5Config.from_preset("tiny"), recompute_granularity="selective", recompute_modules=["layernorm"])


def _warmup_indexer_grads(**recompute):
    """--dsa-stage dense-warmup: everything but the indexers frozen (as training/loop.py does)."""
    megatron_glm5.initialize_model_parallel(seed=11)
    model = build_model(GLM5Config.from_preset("tiny-indexshare"), dsa_stage="dense-warmup",
                        dsa_indexer_loss_coeff=0.1, **recompute).train()
    for n, p in model.named_parameters():
        p.requires_grad_(".indexer." in n)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (2, 41), generator=g).to(model.output_layer.weight.device)
    model(ids[:, :-1], labels=ids[:, 1:]).float().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_selective_core_attn_recompute_keeps_the_warmup_indexer_loss():
    """With only the indexers trainable nothing entering the recomputed core attention needs a gradient, so a
    checkpoint there would never run its backward and the indexer KL loss would silently vanish (grad norm 0)."""
    ref = _warmup_indexer_grads()
    got = _warmup_indexer_grads(recompute_granularity="selective", recompute_modules=["core_attn"])
    assert ref and ref.keys() == got.keys()
    assert all(g.abs().sum() > 0 for g in ref.values())
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], msg=n, rtol=1e-6, atol=1e-9)
