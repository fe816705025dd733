"""Our GLM-5 on megatron-core computes what transformers' GlmMoeDsaForCausalLM computes (CPU, fp32).

The reference is transformers itself: tiny random checkpoints are saved with save_pretrained and loaded through
the public API. Sequences are longer than index_topk so DSA's sparsity bites; the top-k sets are compared with
the indices transformers' own indexer returns.
"""
import pytest
import torch
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave

import megatron_glm5
from hf_tiny import make_hf_model, save_hf_model

SEQ, BATCH = 48, 2  # > index_topk (16) of the tiny presets
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module", params=["tiny", "tiny-indexshare", "tiny-groups"])
def pair(request, tmp_path_factory):
    hf, cfg = make_hf_model(request.param, seed=7)
    path = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    ours = megatron_glm5.from_hf_pretrained(path, dsa_backend="torch", device=DEVICE)
    return request.param, hf.to(DEVICE), ours, cfg


def _capture_attention_inputs(model):
    """The per-forward AttentionInputs (holds our top-k store) as the first attention layer receives it."""
    seen = []
    hook = model.decoder.layers[0].self_attention.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append(kwargs["rotary_pos_emb"]), with_kwargs=True)
    return seen, hook


def _hf_index_scores_fp64(indexer, hidden, q_resid, position_embeddings):
    """transformers' indexer scores recomputed in float64 from its own modules (to check for top-k ties)."""
    ix = indexer.double()
    b, s, _ = hidden.shape
    cos, sin = (t.double() for t in position_embeddings)
    q = ix.wq_b(q_resid.double()).view(b, s, ix.n_heads, ix.head_dim)
    k = ix.k_norm(ix.wk(hidden.double())).unsqueeze(2)
    r = ix.qk_rope_head_dim
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q[..., :r], k[..., :r], cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q[..., r:]], -1)
    k = torch.cat([k_rot, k[..., r:]], -1).squeeze(2)
    scores = torch.relu(torch.einsum("bshd,btd->bsht", q, k) * ix.softmax_scale)
    w = ix.weights_proj(hidden.double()) * ix.n_heads ** -0.5
    out = torch.einsum("bsh,bsht->bst", w, scores)
    ix.float()
    causal = torch.ones(s, s, dtype=torch.bool, device=out.device).tril()
    return out.masked_fill(~causal, float("-inf"))


def test_logits_and_topk_match_transformers(pair):
    name, hf, ours, cfg = pair
    torch.manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), device=DEVICE)

    hf_topk, hf_inputs = {}, {}
    hooks = []
    for i, layer in enumerate(hf.model.layers):
        if layer.self_attn.indexer is not None:
            ix = layer.self_attn.indexer
            hooks.append(ix.register_forward_hook(
                lambda m, args, out, i=i: (hf_topk.__setitem__(i, out), hf_inputs.__setitem__(i, args)) and None))
    seen, hook = _capture_attention_inputs(ours)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        out = ours(ids)
    hook.remove()
    for h in hooks:
        h.remove()

    assert out.shape == ref.shape == (BATCH, SEQ, cfg.vocab_size)
    assert (out - ref).abs().max().item() <= 1e-4
    assert ((out - ref).norm() / ref.norm()).item() <= 1e-5

    store = seen[0].topk_store
    full = [i for i, t in enumerate(cfg.indexer_types) if t == "full"]
    assert sorted(store) == [i + 1 for i in full] and sorted(hf_topk) == full
    k = cfg.index_topk
    with torch.no_grad():
        for i in full:
            hidden, q_resid, pos_emb = hf_inputs[i][:3]
            scores = _hf_index_scores_fp64(hf.model.layers[i].self_attn.indexer, hidden, q_resid, pos_emb)
            ours_idx = store[i + 1].view(BATCH, SEQ, -1).long()
            for bi in range(BATCH):
                for t in range(SEQ):
                    window = t + 1
                    theirs = {j for j in hf_topk[i][bi, t].tolist() if j <= t}
                    mine = {j - bi * SEQ for j in ours_idx[bi, t].tolist() if j >= 0}
                    if window > k:  # the selection is only meaningful without a tie at the boundary
                        top = scores[bi, t, :window].sort(descending=True).values
                        assert top[k - 1] > top[k], f"{name}: tie at the top-k boundary (layer {i}, row {t})"
                    assert mine == theirs, f"{name}: layer {i} batch {bi} row {t}"


def test_hidden_states_match_per_layer(pair):
    name, hf, ours, cfg = pair
    torch.manual_seed(2)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), device=DEVICE)
    theirs, mine = [], []
    hooks = [l.register_forward_hook(lambda m, a, o: theirs.append(o[0] if isinstance(o, tuple) else o) and None)
             for l in hf.model.layers]
    hooks += [l.register_forward_hook(lambda m, a, o: mine.append(o[0].transpose(0, 1)) and None)
              for l in ours.decoder.layers]
    with torch.no_grad():
        hf(input_ids=ids)
        ours(ids)
    for h in hooks:
        h.remove()
    assert len(theirs) == len(mine) == cfg.num_hidden_layers
    for i, (a, b) in enumerate(zip(theirs, mine)):
        rel = ((a - b).norm() / a.norm()).item()
        assert rel <= 1e-5, f"{name}: layer {i} hidden states differ (relative L2 {rel:.2e})"


def test_dense_case_when_sequence_fits_topk(pair):
    """seq <= index_topk: every causal key is kept, so DSA is exactly dense MLA."""
    name, hf, ours, cfg = pair
    torch.manual_seed(3)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, cfg.index_topk), device=DEVICE)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        out = ours(ids)
        assert (out - ref).abs().max().item() <= 1e-4
        # dense-warm-up attention (no selection) gives the same numbers here
        ours.config.dsa_stage = "dense-warmup"
        try:
            dense = ours(ids)
        finally:
            ours.config.dsa_stage = "sparse"
    assert (dense - ref).abs().max().item() <= 1e-4


def test_sparsity_bites_at_this_length(pair):
    """Guard for the tests above: at SEQ the top-k selection changes the logits (dense attention would fail)."""
    name, hf, ours, cfg = pair
    torch.manual_seed(4)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), device=DEVICE)
    with torch.no_grad():
        sparse = ours(ids)
        ours.config.dsa_stage = "dense-warmup"
        try:
            dense = ours(ids)
        finally:
            ours.config.dsa_stage = "sparse"
    assert (sparse - dense).abs().max().item() > 1e-3
