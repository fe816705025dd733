"""IndexShare across pipeline stages: a stage that starts on a 'shared' DSA layer gets the top-k of its full layer
from the previous stage (megatron_glm5/model/pipeline_topk.py).

Distributed (gloo, 2 processes, the harness in tests/layouts_harness.py): the tiny-indexshare model with indexer types
F F S S (an HF config.json, --hf-config), --dsa-stage sparse, trained 6 steps from one shared checkpoint
(``--load --finetune``) and evaluated (forward-only schedule) at steps 0, 3 and 6; every layout's training losses
are within 1e-6 relative of the one-process run, its gradient norms within 5e-6, its validation losses within 1e-6:
- ``pp2-recompute``: layers 0-1 | 2-3 (1F1B) with --recompute-granularity full: stage 1 starts on shared layer 2
  and has no full layer: it receives layer 1's top-k, which both its layers use, in the forward and again in
  the recomputation in backward;
- ``pp2-vpp2``: --vpp 2 (interleaved), chunks rank0/c0 = layer 0, rank1/c0 = 1, rank0/c1 = 2, rank1/c1 = 3: layer
  1's top-k crosses the wrap-around (rank 1 chunk 0 -> rank 0 chunk 1), and rank 0's chunk 1, which has no full
  layer, forwards it to rank 1's chunk 1.
Measured (2026-11-30, this CPU machine): every training and validation loss bit-identical to the one-process run,
gradient norms within 9e-8 relative. Without the top-k transfer a stage that starts on a shared layer stops at
its first forward ("IndexShare layer 3 needs the top-k of full layer 2, which did not run before it"); with the
previous micro-batch's top-k (a receive order off by one, tried by hand at pp2) the losses moved by 1.2e-3 to
3.5e-3 relative, the gradient norms by up to 2e-2 (top-16 of up to 64 keys).

In process: the layout decisions (which chunk sends / receives which layer's top-k, the GLM-5.3 recipe's split),
and send/receive through a fake communicator feeding the shared layers of a second "stage".
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from layouts_harness import LOSS_RTOL, STEPS, _assert_steps_match, _rel, _train

REPO = Path(__file__).resolve().parents[1]
FFSS = ["full", "full", "shared", "shared"]
EVAL = ["--eval-interval", "3", "--eval-iters", "1"]

PP_LAYOUTS = {
    "pp2-recompute": ["--pp", "2", "--recompute-granularity", "full"],
    "pp2-vpp2": ["--pp", "2", "--vpp", "2"],
}


def _ffss_config():
    from megatron_glm5.config import GLM5Config

    return GLM5Config.from_preset("tiny-indexshare").replace(indexer_types=list(FFSS))


def _validation(out: Path) -> dict:
    recs = map(json.loads, (out / "tb" / "metrics.jsonl").read_text().splitlines())
    return {r["iteration"]: r["validation/lm-loss"] for r in recs if "validation/lm-loss" in r}


@pytest.fixture(scope="module")
def ffss_reference(tmp_path_factory):
    """(common flags, start checkpoint, reference steps, reference validation losses, work directory)."""
    root = tmp_path_factory.mktemp("indexshare_pp")
    hf = _ffss_config().save_hf(root / "hf")
    common = ["--hf-config", hf, "--dsa-stage", "sparse", *EVAL]
    start = root / "start"
    _train(1, root / "start_run", *common, "--train-iters", "1", "--save", str(start))
    ref = _train(1, root / "ref", *common, "--load", str(start), "--finetune", "--train-iters", str(STEPS),
                 "--no-save")
    assert sorted(ref) == list(range(1, STEPS + 1))
    ref_valid = _validation(root / "ref")
    assert sorted(ref_valid) == [0, 3, 6]
    return common, start, ref, ref_valid, root


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(PP_LAYOUTS))
def test_indexshare_across_pipeline_stages_matches_single_process(ffss_reference, layout):
    common, start, ref, ref_valid, root = ffss_reference
    out = root / layout
    run = _train(2, out, *common, "--load", str(start), "--finetune", "--train-iters", str(STEPS), "--no-save",
                 *PP_LAYOUTS[layout])
    _assert_steps_match(run, ref, range(1, STEPS + 1), layout)
    valid = _validation(out)
    assert sorted(valid) == sorted(ref_valid), f"{layout}: validation at {sorted(valid)}"
    bad = {i: (valid[i], ref_valid[i]) for i in ref_valid if _rel(valid[i], ref_valid[i]) > LOSS_RTOL}
    assert not bad, f"{layout}: validation loss differs by more than {LOSS_RTOL:g} (run, ref): {bad}"


# ---------------------------------------------------------------------------------------------------------------
# Layout decisions (config only)
# ---------------------------------------------------------------------------------------------------------------


def _links(tcfg):
    from megatron_glm5.model.pipeline_topk import _chunks, topk_links

    return {(r, vp): (lambda l: (l.receive, l.send))(topk_links(tcfg, vp, r)) for r, vp in _chunks(tcfg)}


def test_which_chunk_sends_and_receives_which_top_k():
    """Layer numbers are megatron's (1-based): 0-based layer i stores its top-k under i + 1."""
    from megatron_glm5.config import GLM5Config
    from megatron_glm5.model.pipeline_topk import check_pipeline_split, needs_topk_transfer

    fsfs = GLM5Config.from_preset("tiny-indexshare")
    assert list(fsfs.indexer_types) == ["full", "shared", "full", "shared"]
    cases = [
        (fsfs, dict(pipeline_model_parallel_size=2), {(0, None): (None, None), (1, None): (None, None)}),
        (fsfs, dict(pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=1),
         {(0, None): (None, 1), (1, None): (1, None)}),
        (fsfs, dict(pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=3),
         {(0, None): (None, 3), (1, None): (3, None)}),
        (fsfs, dict(pipeline_model_parallel_size=4),
         {(0, None): (None, 1), (1, None): (1, None), (2, None): (None, 3), (3, None): (3, None)}),
        (fsfs, dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
         {(0, 0): (None, 1), (1, 0): (1, None), (0, 1): (None, 3), (1, 1): (3, None)}),
        # F F S S: the wrap-around (rank 1 chunk 0 -> rank 0 chunk 1) and a chunk without a full layer forwarding
        (_ffss_config(), dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
         {(0, 0): (None, None), (1, 0): (None, 2), (0, 1): (2, 2), (1, 1): (2, None)}),
        (_ffss_config(), dict(pipeline_model_parallel_size=2), {(0, None): (None, 2), (1, None): (2, None)}),
        # dense warm-up selects no keys: nothing flows
        (fsfs, dict(pipeline_model_parallel_size=4, dsa_stage="dense-warmup"),
         {(r, None): (None, None) for r in range(4)}),
    ]
    for cfg, kw, want in cases:
        tcfg = cfg.to_transformer_config(**kw)
        check_pipeline_split(tcfg)
        assert _links(tcfg) == want, kw
        assert needs_topk_transfer(tcfg) == any(r is not None for r, _ in want.values()), kw


def test_glm53_recipe_split_passes_and_passes_top_k_on():
    """examples/recipes/glm5.3_sft_32x8.yaml: 78 layers 18 / 21 / 21 / 18 over PP4. GLM-5.3's layers are
    F F F S S S F S S S F ... (a full layer every 4 from layer 2): stage 2 starts on shared layer 39 (full layer
    38 on stage 1), stage 3 on shared layer 60 (full layer 58 on stage 2)."""
    from megatron_glm5.arguments import args_to_overrides, parse_args, validate_args
    from megatron_glm5.model.pipeline_topk import check_pipeline_split

    args = validate_args(parse_args(["--config", str(REPO / "examples/recipes/glm5.3_sft_32x8.yaml")]),
                         world_size=256, check_device=False)
    tcfg = args.model_config.to_transformer_config(**args_to_overrides(args))
    assert (tcfg.pipeline_model_parallel_size, tcfg.num_layers_in_first_pipeline_stage,
            tcfg.num_layers_in_last_pipeline_stage, tcfg.dsa_stage) == (4, 18, 18, "sparse")
    types = tcfg.dsa_indexer_types
    assert (types[38], types[39], types[58], types[59], types[60]) == ("full", "shared", "full", "shared", "shared")
    check_pipeline_split(tcfg)
    assert _links(tcfg) == {(0, None): (None, None), (1, None): (None, 39), (2, None): (39, 59),
                            (3, None): (59, None)}


def test_combined_1f1b_schedule_is_still_refused():
    """megatron-core's combined 1F1B schedule (overlap_moe_expert_parallel_comm) runs the layers without
    TransformerBlock.forward, where the top-k is passed on: a split that needs it is refused when built."""
    from megatron_glm5.model.pipeline_topk import IndexShareAcrossStagesError, check_pipeline_split

    tcfg = _ffss_config().to_transformer_config(pipeline_model_parallel_size=2)
    tcfg.overlap_moe_expert_parallel_comm = True  # set after __post_init__, which wants TE / EP for it
    with pytest.raises(IndexShareAcrossStagesError, match=r"pipeline stage 1 starts on layer 2 .* full layer 1"):
        check_pipeline_split(tcfg)
    tcfg.dsa_stage = "dense-warmup"  # no top-k flows in the warm-up
    check_pipeline_split(tcfg)


# ---------------------------------------------------------------------------------------------------------------
# send / receive feeding the shared layers of the next stage (in process, fake communicator)
# ---------------------------------------------------------------------------------------------------------------


class _FakeComm:
    """Stands in for torch.distributed's isend / recv: a queue of what was sent."""

    def __init__(self):
        self.sent, self.calls = [], []

    def isend(self, t, dst, group):
        self.calls.append(("isend", dst, group, tuple(t.shape), t.dtype))
        self.sent.append(t.clone())

        class Work:
            def is_completed(self):
                return True

            def wait(self):
                return True
        return Work()

    def recv(self, t, src, group):
        self.calls.append(("recv", src, group, tuple(t.shape), t.dtype))
        t.copy_(self.sent.pop(0))


@pytest.fixture
def ffss_layers(monkeypatch):
    """The 4 decoder layers of the F F S S model (one process), a fake communicator and hidden states for two
    different micro-batches."""
    from megatron_glm5.model import pipeline_topk
    from megatron_glm5.model.model import build_model

    model = build_model(_ffss_config(), mtp=False, dsa_stage="sparse")
    comm = _FakeComm()
    monkeypatch.setattr(pipeline_topk.dist, "isend", comm.isend)
    monkeypatch.setattr(pipeline_topk.dist, "recv", comm.recv)
    monkeypatch.setattr(pipeline_topk, "_LINKS", pipeline_topk._Links(None, "to-next", 1, "from-prev", 0))
    g = torch.Generator().manual_seed(0)
    cfg = model.config
    hidden = [torch.randn(40, 2, cfg.hidden_size, generator=g) for _ in range(2)]  # [s, b, H]
    return model.decoder.layers, comm, hidden, cfg


def _inputs(cfg, s, b):
    from megatron_glm5.model.attention_inputs import build_attention_inputs

    return build_attention_inputs(torch.arange(s).expand(b, s), cfg.qk_pos_emb_head_dim, cfg.rotary_base)


def _run(layers, x, inputs):
    for layer in layers:
        x, _ = layer(hidden_states=x, attention_mask=None, rotary_pos_emb=inputs)
    return x


def test_sent_top_k_feeds_the_shared_layers_of_the_next_stage(ffss_layers):
    """'Stage 0' runs layers 0-1 and sends layer 1's top-k (key 2); 'stage 1' builds its own inputs, receives it and
    runs shared layers 2-3: the same output as the four layers in one forward. Without the receive the first
    shared layer refuses to run; with the top-k of another micro-batch its output differs."""
    from megatron_glm5.model import pipeline_topk

    layers, comm, hidden, cfg = ffss_layers
    assert [lay.self_attention.core_attention.index_mode for lay in layers] == ["full", "full", "shared", "shared"]
    s, b = hidden[0].shape[:2]
    with torch.no_grad():
        whole = _run(layers, hidden[0], _inputs(cfg, s, b))
        first = _inputs(cfg, s, b)
        mid = _run(layers[:2], hidden[0], first)
        pipeline_topk.send(first, 2)
        assert comm.calls == [("isend", 1, "to-next", (b * s, cfg.dsa_index_topk), pipeline_topk.TOPK_DTYPE)]

        second = _inputs(cfg, s, b)
        pipeline_topk.receive(second, 2, cfg.dsa_index_topk)
        assert comm.calls[-1] == ("recv", 0, "from-prev", (b * s, cfg.dsa_index_topk), pipeline_topk.TOPK_DTYPE)
        assert torch.equal(second.topk_store[2], first.topk_store[2])
        assert torch.equal(_run(layers[2:], mid, second), whole)

        with pytest.raises(RuntimeError, match="IndexShare layer 3 needs the top-k of full layer 2"):
            _run(layers[2:], mid, _inputs(cfg, s, b))

        other = _inputs(cfg, s, b)
        _run(layers[:2], hidden[1], other)  # another micro-batch's top-k
        pipeline_topk.send(other, 2)
        wrong = _inputs(cfg, s, b)
        pipeline_topk.receive(wrong, 2, cfg.dsa_index_topk)
        assert not torch.equal(wrong.topk_store[2], first.topk_store[2])
        assert not torch.allclose(_run(layers[2:], mid, wrong), whole, rtol=1e-4, atol=0)
    pipeline_topk.wait_pending_sends()


def test_receive_takes_its_width_from_the_window(ffss_layers):
    """Sequences shorter than index_topk select every key: the received top-k is [T, max_window] wide, as the
    sending stage's indexer computes it."""
    from megatron_glm5.model import pipeline_topk

    layers, comm, _, cfg = ffss_layers
    s, b = 6, 2
    assert s < cfg.dsa_index_topk
    first = _inputs(cfg, s, b)
    with torch.no_grad():
        _run(layers[:2], torch.randn(s, b, cfg.hidden_size), first)
    assert tuple(first.topk_store[2].shape) == (b * s, s)
    pipeline_topk.send(first, 2)
    second = _inputs(cfg, s, b)
    pipeline_topk.receive(second, 2, cfg.dsa_index_topk)
    assert torch.equal(second.topk_store[2], first.topk_store[2])
    pipeline_topk.wait_pending_sends()


def test_top_k_dtype_is_the_reference_ops(ffss_layers):
    """The receiver allocates TOPK_DTYPE without seeing the sender's tensor: it must be what the indexer makes."""
    from megatron_glm5.model import pipeline_topk

    layers, _, hidden, cfg = ffss_layers
    inputs = _inputs(cfg, *hidden[0].shape[:2])
    with torch.no_grad():
        _run(layers[:2], hidden[0], inputs)
    assert inputs.topk_store[2].dtype == pipeline_topk.TOPK_DTYPE
