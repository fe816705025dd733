"""--cross-entropy-fusion (model/linear_cross_entropy.py): the chunked output layer + cross entropy gives the loss
and the gradients of the unfused path (fp32, tight tolerance): as a function (several chunks, a loss mask,
two tensor-parallel vocabulary shards) and in the tiny model against megatron-core's own path."""

import pytest
import torch

from megatron_glm5.model.cross_entropy_flags import CrossEntropyFusionError, config_overrides
from megatron_glm5.model.linear_cross_entropy import chunked_linear_cross_entropy
from thread_group import ThreadGroup


def _inputs(seed=0, n=(5, 2), h=16, v=37):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * 0.3
    labels = torch.randint(0, v, n, generator=g)
    mask = (torch.rand(n, generator=g) > 0.3).double()
    grad_scale = 0.37
    return hidden, weight, labels, mask, grad_scale


def _reference(hidden, weight, labels, mask, scale):
    """The textbook loss: full logits, log-softmax, masked sum."""
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = hidden @ weight.t()
    loss = -torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    (scale * (loss * mask).sum()).backward()
    return loss.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("chunk", [1, 5, 64])  # vocabulary rows per slice (37 in all)
def test_chunked_matches_textbook_loss_and_grads(chunk):
    hidden, weight, labels, mask, scale = _inputs()
    ref_loss, ref_dh, ref_dw = _reference(hidden, weight, labels, mask, scale)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = chunked_linear_cross_entropy(h, w, labels, chunk=chunk)
    assert loss.shape == labels.shape and loss.dtype == torch.float32
    (scale * (loss * mask).sum()).backward()
    # the fp32 loss buffer: float32 precision
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h.grad, ref_dh, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.grad, ref_dw, rtol=1e-6, atol=1e-6)
    assert h.grad[mask == 0].abs().max() == 0  # masked tokens get no gradient


def test_chunked_tp2_vocab_parallel(monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from megatron_glm5.model import linear_cross_entropy as lce

    world = 2
    comm = ThreadGroup(world)
    monkeypatch.setattr(lce, "tp_shard", lambda group: (group, comm.local.rank, world))
    monkeypatch.setattr(torch.distributed, "all_reduce", comm.all_reduce)
    hidden, weight, labels, mask, scale = _inputs(seed=1, v=38)
    shard = weight.shape[0] // world

    def rank_run(rank):
        comm.local.rank = rank
        w = weight[rank * shard:(rank + 1) * shard].clone().requires_grad_()
        h = hidden.clone().requires_grad_()
        loss = chunked_linear_cross_entropy(h, w, labels, tp_group="tp", chunk=7)
        (scale * (loss * mask).sum()).backward()
        return {"loss": loss.detach(), "dh": h.grad, "dw": w.grad}

    with ThreadPoolExecutor(world) as pool:
        parts = list(pool.map(rank_run, range(world)))
    ref_loss, ref_dh, ref_dw = _reference(hidden, weight, labels, mask, scale)
    for p in parts:  # every rank has the full loss; the hidden gradient is each shard's part (the region sums)
        torch.testing.assert_close(p["loss"].double(), ref_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(parts[0]["dh"] + parts[1]["dh"], ref_dh, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.cat([parts[0]["dw"], parts[1]["dw"]]), ref_dw, rtol=1e-6, atol=1e-6)
    assert all(p["dh"].abs().sum() > 0 for p in parts)


def test_model_chunked_equals_unfused():
    from megatron_glm5.config import GLM5Config
    from megatron_glm5.model.model import build_model

    cfg = GLM5Config.from_preset("tiny")
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=g)
    mask = (torch.rand(2, 16, generator=g) > 0.25).float()
    results, weights = {}, None
    for choice in ("none", "chunked"):
        model = build_model(cfg, mtp=False, **config_overrides(choice)).train()
        if weights is None:
            weights = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
        else:
            missing, unexpected = model.load_state_dict(weights, strict=False)
            assert not unexpected and all(k.endswith("_extra_state") for k in missing)
        loss = model(ids[:, :-1], labels=ids[:, 1:])
        (loss * mask).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[choice] = (loss.detach(), grads)
    ref_loss, ref_grads = results["none"]
    for choice in ("chunked",):
        loss, grads = results[choice]
        assert loss.shape == (2, 16)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        assert grads.keys() == ref_grads.keys()
        for name in ref_grads:
            ref = ref_grads[name]  # fp32 sums in another order: tolerance relative to the largest entry
            torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=1e-5 * float(ref.abs().max()) + 1e-9,
                                       msg=name)
    out_w = [n for n in ref_grads if "output_layer" in n]
    assert out_w and results["chunked"][1][out_w[0]].abs().sum() > 0


def test_flag_and_config_overrides():
    from megatron_glm5.arguments import build_parser

    assert build_parser("pretrain").parse_args([]).cross_entropy_fusion == "none"
    args = build_parser("pretrain").parse_args(["--cross-entropy-fusion", "chunked"])
    assert config_overrides(args.cross_entropy_fusion) == {"cross_entropy_fusion": "chunked"}
    with pytest.raises(CrossEntropyFusionError, match="--cross-entropy-fusion must be one of none, chunked"):
        config_overrides("fused")
