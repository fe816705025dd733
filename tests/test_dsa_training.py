"""The indexer's KL loss trains the indexer and only the indexer; top-k is deterministic."""
import pytest
import torch

import megatron_glm5
from megatron_glm5 import GLM5Config, build_model

SEQ, BATCH = 40, 2


def _grads(stage: str, coeff: float, seed: int = 0):
    megatron_glm5.initialize_model_parallel(seed=seed)
    model = build_model(GLM5Config.from_preset("tiny-indexshare"), mtp=False, dsa_stage=stage,
                        dsa_indexer_loss_coeff=coeff, dsa_backend="torch").train()
    g = torch.Generator().manual_seed(123)
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ + 1), generator=g).to(model.output_layer.weight.device)
    loss = model(ids[:, :-1], labels=ids[:, 1:]).float().mean()
    loss.backward()
    grads = {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}
    kl = [m.last_indexer_loss for m in model.modules() if getattr(m, "indexer", None) is not None]
    return grads, kl


@pytest.mark.parametrize("stage", ["dense-warmup", "sparse"])
def test_indexer_loss_trains_only_the_indexer(stage):
    with_loss, kl = _grads(stage, coeff=0.5)
    without, _ = _grads(stage, coeff=0.0)
    assert kl and all(x is not None and x.item() > 0 for x in kl)
    indexer = [n for n in with_loss if ".indexer." in n]
    assert indexer
    for n in indexer:
        assert with_loss[n] is not None and with_loss[n].abs().sum() > 0, f"{n} got no gradient from the KL loss"
        assert without[n] is None or without[n].abs().sum() == 0, f"{n} has a gradient without the KL loss"
    for n in with_loss:
        if ".indexer." in n:
            continue
        a, b = with_loss[n], without[n]
        assert (a is None) == (b is None), n
        if a is not None:
            if a.is_cuda:  # CUDA's embedding / index_add backward accumulate with atomics: equal up to rounding
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8, msg=f"{n}: the indexer loss changed it")
            else:
                assert torch.equal(a, b), f"{n}: the indexer loss changed a main-model gradient"


def test_freeze_indexer_has_no_trainable_indexer():
    model = build_model(GLM5Config.from_preset("tiny"), mtp=False, dsa_freeze_indexer=True,
                        dsa_indexer_loss_coeff=1.0).train()
    assert all(not p.requires_grad for n, p in model.named_parameters() if ".indexer." in n)
    ids = torch.randint(0, model.config.vocab_size, (1, SEQ + 1)).to(model.output_layer.weight.device)
    model(ids[:, :-1], labels=ids[:, 1:]).float().mean().backward()
    assert all(m.last_indexer_loss is None for m in model.modules() if getattr(m, "indexer", None) is not None)


def test_topk_is_bitwise_deterministic():
    model = build_model(GLM5Config.from_preset("tiny"), mtp=False).eval()
    ids = torch.randint(0, model.config.vocab_size, (BATCH, 64)).to(model.output_layer.weight.device)
    stores = []
    hook = model.decoder.layers[0].self_attention.register_forward_pre_hook(
        lambda m, a, kw: stores.append(kw["rotary_pos_emb"]), with_kwargs=True)
    with torch.no_grad():
        first = model(ids)
        second = model(ids)
    hook.remove()
    assert torch.equal(first, second)
    a, b = stores[0].topk_store, stores[1].topk_store
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_repeated_mtp_layer_shares_its_topk_over_steps():
    """GLM-5's one MTP module applied for 3 steps (one set of weights); with index_share_for_mtp_iteration the
    later steps reuse the first step's top-k, and only the first step trains the MTP indexer."""
    megatron_glm5.initialize_model_parallel(seed=2)
    cfg = GLM5Config.from_preset("tiny-indexshare")  # index_share_for_mtp_iteration = True
    model = build_model(cfg, mtp_num_layers=3, mtp_use_repeated_layer=True, dsa_indexer_loss_coeff=0.5).train()
    assert len(model.mtp.layers) == 1
    calls = []
    indexer = model.mtp.layers[0].mtp_model_layer.self_attention.core_attention.indexer
    indexer.register_forward_hook(lambda m, a, o: calls.append(1) and None)
    seen = []
    model.mtp.layers[0].mtp_model_layer.self_attention.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["rotary_pos_emb"].mtp_step), with_kwargs=True)
    ids = torch.randint(0, cfg.vocab_size, (1, SEQ + 1)).to(model.output_layer.weight.device)
    model(ids[:, :-1], labels=ids[:, 1:]).float().mean().backward()
    assert seen == [0, 1, 2] and len(calls) == 1
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in indexer.parameters())


def test_dsa_chunk_size_reaches_the_ops_and_does_not_change_results():
    megatron_glm5.initialize_model_parallel(seed=4)
    model = build_model(GLM5Config.from_preset("tiny"), mtp=False, dsa_chunk_size=7).eval()
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ)).to(model.output_layer.weight.device)
    backend = model.decoder.layers[0].self_attention.core_attention.backend
    seen = []
    originals = {name: getattr(backend, name) for name in ("indexer_topk", "sparse_mla")}

    def spy(name):
        def call(*a, **kw):
            seen.append((name, kw.get("chunk_size")))
            return originals[name](*a, **kw)
        return call
    with torch.no_grad():
        for name in originals:
            setattr(backend, name, spy(name))
        try:
            chunked = model(ids)
        finally:
            for name, fn in originals.items():
                setattr(backend, name, fn)
        model.config.dsa_chunk_size = 1024
        whole = model(ids)
    assert seen and all(c == 7 for _, c in seen)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)
