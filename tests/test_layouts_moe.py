"""MoE layouts on CPU: the hybridep (hierarchical) token dispatcher, TP2 x EP2 with expert TP 1, and the errors of
layouts that do not divide the model.

Training runs use tests/layouts_harness.py (its single-process reference from a shared starting
checkpoint, 6 steps, LM loss within 1e-6 relative and gradient norm within 5e-6); four processes each:
- ``--ep 4 --dispatcher hybridep --node-size 2``: two simulated nodes of two ranks, so both stages (across nodes,
  then inside the node) carry tokens; it matches the single-process run and the alltoall run at EP4;
- ``--tp 2 --ep 2 --etp 1``: sequence-parallel attention, experts split over EP only, two expert data-parallel
  replicas.
Measured (2026-11-30, this CPU machine): all three within 1.7e-7 relative in LM loss (the same largest step
difference as the EP2 / TP2 layouts of test_layouts_cpu), gradient norms within 2.2e-7 (EP4 alltoall and
hybridep) and 9.2e-7 (TP2 x EP2); hybridep against alltoall at EP4: 8.2e-8 in loss, 8.0e-8 in gradient norm.

The dispatcher alone (tests/hybridep_dispatch_tool.py, four processes): random tokens, top-3 routing of 8 experts
and combine weights through megatron-core's MoEAlltoAllTokenDispatcher and HierarchicalTokenDispatcher, at
--node-size 1 (4 nodes: only the inter-node stage), 2 and 4 (1 node: only the intra-node stage). Outputs and the
gradients of tokens and combine weights agree within 4e-8 relative (norm of the difference; measured), every
expert receives the same rows, and each token crosses to a node once however many of that node's experts it
selected. With the relay's chunk order broken (combine_preprocess returning its input) the differences are ~1.
"""
from __future__ import annotations

import pytest
import torch

from layouts_harness import STEPS, _assert_steps_match, _launch, _train

DISPATCH_TOOL = "tests/hybridep_dispatch_tool.py"
DISPATCH_RTOL = 1e-6
EP4 = ["--ep", "4", "--micro-batch-size", "1", "--num-workers", "0"]  # DP4: one micro-batch of 1 per rank


# ---------------------------------------------------------------------------------------------------------------
# The dispatcher alone
# ---------------------------------------------------------------------------------------------------------------


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


@pytest.mark.distributed
def test_hierarchical_dispatch_matches_alltoall(tmp_path):
    _launch(4, DISPATCH_TOOL, ["--out", str(tmp_path), "--node-sizes", "1,2,4"], tmp_path / "log.txt")
    experts, local = 8, 2
    for node_size, layout in ((1, (1, 4, 1, 4)), (2, (2, 2, 2, 2)), (4, (4, 1, 4, 1))):
        for rank in range(4):
            r = torch.load(tmp_path / f"node{node_size}.rank{rank}.pt")
            what = f"--node-size {node_size}, rank {rank}"
            assert r["layout"] == layout, what  # (EP ranks per node, nodes, intra group size, inter group size)
            a, h = r["alltoall"], r["hybridep"]
            assert h["counts"] == a["counts"], what
            assert all(torch.equal(x, y) for x, y in zip(h["received"], a["received"])), what
            for key in ("out", "grad_x", "grad_probs"):
                assert _rel(h[key], a[key]) < DISPATCH_RTOL, (what, key, _rel(h[key], a[key]))
            # each token goes once to every node holding one of its experts, not once per expert
            per_node = r["routing_map"].view(-1, experts // (node_size * local), node_size * local).any(-1)
            assert r["rows_sent_per_node"] == per_node.sum(0).tolist(), what
            if node_size == 2:
                assert sum(r["rows_sent_per_node"]) < r["routing_map"].sum().item(), what


@pytest.mark.distributed
def test_hierarchical_dispatch_with_fused_permute_matches_alltoall(tmp_path):
    """--moe-permute-fusion in the hierarchical dispatcher (both gathers and both sums are the Triton kernels, here
    in Triton's CPU interpreter): the same outputs and gradients as megatron-core's unfused alltoall dispatcher."""
    pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
    _launch(4, DISPATCH_TOOL, ["--out", str(tmp_path), "--node-sizes", "2", "--fused"], tmp_path / "log.txt")
    for rank in range(4):
        r = torch.load(tmp_path / f"node2.rank{rank}.pt")
        assert r["fused"] is True and r["layout"] == (2, 2, 2, 2)
        a, h = r["alltoall"], r["hybridep"]
        assert h["counts"] == a["counts"]
        assert all(torch.equal(x, y) for x, y in zip(h["received"], a["received"]))
        for key in ("out", "grad_x", "grad_probs"):
            assert _rel(h[key], a[key]) < DISPATCH_RTOL, (rank, key, _rel(h[key], a[key]))


# ---------------------------------------------------------------------------------------------------------------
# Training: hybridep at EP4 over two simulated nodes, TP2 x EP2
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.distributed
def test_hybridep_two_nodes_matches_alltoall_and_single_process(layouts_reference):
    start, _, ref, root = layouts_reference
    common = ["--load", str(start), "--finetune", "--train-iters", str(STEPS), "--no-save", *EP4]
    alltoall = _train(4, root / "ep4-alltoall", *common)
    hybridep = _train(4, root / "ep4-hybridep", *common, "--dispatcher", "hybridep", "--node-size", "2")
    assert "torch.distributed hierarchical dispatcher" in (root / "ep4-hybridep" / "log.txt").read_text()
    steps = range(1, STEPS + 1)
    _assert_steps_match(alltoall, ref, steps, "ep4 alltoall")
    _assert_steps_match(hybridep, ref, steps, "ep4 hybridep (2 nodes x 2)")
    _assert_steps_match(hybridep, alltoall, steps, "ep4 hybridep vs alltoall")


@pytest.mark.distributed
def test_tp2_ep2_etp1_matches_single_process(layouts_reference):
    start, _, ref, root = layouts_reference
    run = _train(4, root / "tp2-ep2", "--load", str(start), "--finetune", "--train-iters", str(STEPS), "--no-save",
                 "--tp", "2", "--ep", "2", "--etp", "1", "--num-workers", "0")
    _assert_steps_match(run, ref, range(1, STEPS + 1), "tp2 x ep2 (etp 1)")


# ---------------------------------------------------------------------------------------------------------------
# Selection and node layout (in process)
# ---------------------------------------------------------------------------------------------------------------


def test_backend_choice_needs_both_cuda_and_hybridep():
    from megatron_glm5.model.hybridep_dispatcher import choose_backend

    assert choose_backend(cuda_available=True, hybridep_importable=True) == "deep_ep"
    assert choose_backend(cuda_available=True, hybridep_importable=False) == "torch"
    assert choose_backend(cuda_available=False, hybridep_importable=True) == "torch"
    assert choose_backend(cuda_available=False, hybridep_importable=False) == "torch"


def test_ep_ranks_per_node_from_global_ranks():
    from megatron_glm5.model.hybridep_dispatcher import HybridEPLayoutError, ep_ranks_per_node

    assert ep_ranks_per_node(range(4), 2) == 2
    assert ep_ranks_per_node(range(8, 16), 4) == 4
    assert ep_ranks_per_node(range(4), 8) == 4  # the whole EP group inside one node
    assert ep_ranks_per_node([0, 2, 4, 6], 4) == 2  # EP ranks strided by expert TP 2
    assert ep_ranks_per_node(range(4), 1) == 1
    with pytest.raises(HybridEPLayoutError, match=r"--node-size 2 must divide --ep 3"):
        ep_ranks_per_node([0, 1, 2], 2)
    assert ep_ranks_per_node([2, 3, 4, 5], 4) == 2  # two ranks on each of two nodes
    with pytest.raises(HybridEPLayoutError, match=r"--node-size 4 must divide --ep 6"):
        ep_ranks_per_node(range(6), 4)  # 4 + 2
    with pytest.raises(HybridEPLayoutError):
        ep_ranks_per_node([0, 4, 1, 5], 4)  # a node's ranks must be consecutive EP ranks


def _tiny_layer_config(**overrides):
    from megatron_glm5.config import GLM5Config

    return GLM5Config.from_preset("tiny").to_transformer_config(**overrides)


def test_hybridep_torch_path_refuses_expert_tp():
    from megatron_glm5.errors import UserError
    from megatron_glm5.model.hybridep_dispatcher import setup_hybridep_groups

    cfg = _tiny_layer_config(moe_token_dispatcher_type="hybridep", expert_tensor_parallel_size=2)
    with pytest.raises(UserError, match=r"--dispatcher hybridep with --etp 2: .* --etp 1 only"):
        setup_hybridep_groups(cfg)


@pytest.fixture
def tiny_hybridep_model(monkeypatch):
    from megatron_glm5.config import GLM5Config
    from megatron_glm5.model import hybridep_dispatcher
    from megatron_glm5.model.model import build_model

    def build(backend):
        monkeypatch.setattr(hybridep_dispatcher, "_BACKEND", backend)
        return build_model(GLM5Config.from_preset("tiny"), moe_token_dispatcher_type="hybridep", mtp=False)
    return build


def _moe_layers(model):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [m for m in model.modules() if isinstance(m, MoELayer)]


def test_hybridep_layers_use_the_hierarchical_dispatcher_without_deep_ep(tiny_hybridep_model):
    from megatron_glm5.model.hybridep_dispatcher import HierarchicalTokenDispatcher

    model = tiny_hybridep_model("torch")
    layers = _moe_layers(model)
    assert layers
    for layer in layers:
        assert type(layer.token_dispatcher) is HierarchicalTokenDispatcher
        assert layer.config.moe_token_dispatcher_type == "alltoall"  # what the layer runs: alltoall's interface
    assert model.config.moe_token_dispatcher_type == "hybridep"


def test_hybridep_layers_use_megatron_flex_hybridep_with_deep_ep(tiny_hybridep_model, monkeypatch):
    """With deep_ep + CUDA the layer builds megatron-core's flex dispatcher on a config naming the hybridep
    backend (the flex dispatcher itself needs the GPU kernels: a stand-in records what it is given)."""
    from megatron.core.transformer.moe import moe_layer

    seen = []

    class FlexStandIn:
        def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None):
            seen.append((config.moe_token_dispatcher_type, config.moe_flex_dispatcher_backend))

    monkeypatch.setattr(moe_layer, "MoEFlexTokenDispatcher", FlexStandIn)
    layers = _moe_layers(tiny_hybridep_model("deep_ep"))
    assert seen and set(seen) == {("flex", "hybridep")} and len(seen) == len(layers)
    assert all(isinstance(layer.token_dispatcher, FlexStandIn) for layer in layers)


# ---------------------------------------------------------------------------------------------------------------
# Layouts that do not divide the model: one line naming the flags. Heads (--tp 3), experts (--ep 3), expert width
# (--etp 3), layers (--pp 3, --decoder-first-pipeline-num-layers), --seq-length vs --tp and vs 2 x --cp alone and
# --node-size vs the world size are in tests/test_arguments.py (test_validation_errors_name_the_flag).
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, world, needles",
    [
        (["--dispatcher", "hybridep", "--ep", "4", "--node-size", "3"], 12, ["--node-size 3", "--ep 4"]),
        (["--dispatcher", "hybridep", "--ep", "8", "--node-size", "6"], 24, ["--node-size 6", "--ep 8"]),
        (["--dispatcher", "hybridep", "--ep", "2", "--etp", "2", "--node-size", "6", "--tp", "2"], 24,
         ["--node-size 6", "--ep 2 x --etp 2 = 4"]),
        (["--tp", "4", "--cp", "2", "--seq-length", "132"], 8, ["--seq-length 132", "--tp 4 x --cp 2 = 8"]),
        (["--tp", "8"], 8, ["--tp 8", "num_attention_heads 4"]),
        (["--ep", "16"], 16, ["--ep 16", "n_routed_experts 8"]),
        (["--pp", "3", "--decoder-last-pipeline-num-layers", "1"], 3,
         ["--decoder-last-pipeline-num-layers 1", "3 of the model's 4 layers", "2 middle pipeline stage(s)"]),
    ],
    ids=["node-size-vs-ep", "node-size-vs-ep-2", "node-size-vs-ep-x-etp", "seq-vs-tp-x-cp", "tp-vs-heads",
         "ep-above-experts", "last-stage-layers"],
)
def test_layout_not_dividing_is_one_line_naming_the_flags(argv, world, needles):
    from megatron_glm5.arguments import ArgumentError, parse_args, validate_args

    with pytest.raises(ArgumentError) as ei:
        validate_args(parse_args(argv + ["--micro-batch-size", "1"]), world)
    message = str(ei.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, (needle, message)
    assert ei.value.flag is not None and ei.value.flag.startswith("--")


def test_node_sizes_that_form_whole_nodes_are_accepted():
    from megatron_glm5.arguments import args_to_overrides, parse_args, validate_args

    for argv, world in ((["--ep", "4", "--node-size", "2"], 4), (["--ep", "2", "--node-size", "4"], 8),
                        (["--ep", "4", "--node-size", "8"], 4), (["--ep", "8", "--node-size", "4"], 8)):
        args = validate_args(parse_args(["--dispatcher", "hybridep", "--micro-batch-size", "1", *argv]), world)
        assert args_to_overrides(args)["moe_hybridep_node_size"] == int(argv[-1])
    assert "moe_hybridep_node_size" not in args_to_overrides(validate_args(parse_args(["--node-size", "2"]), 1))
    assert _tiny_layer_config(moe_hybridep_node_size=2).moe_hybridep_node_size == 2  # a real config field


# ---------------------------------------------------------------------------------------------------------------
# Resume at another world size: the global batch is the checkpoint's
# ---------------------------------------------------------------------------------------------------------------


def _run_steps(nproc: int, out, flags) -> dict:
    """finetune_glm5.py with exactly ``flags`` (the harness's _train adds --global-batch-size); {iteration: metrics}."""
    import json

    out.mkdir(parents=True, exist_ok=True)
    _launch(nproc, "finetune_glm5.py", [*flags, "--tensorboard-dir", str(out / "tb")], out / "log.txt")
    records = [json.loads(line) for line in (out / "tb" / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r for r in records if "lm-loss" in r}


@pytest.mark.distributed
def test_ep2_checkpoint_resumes_in_one_process_with_its_global_batch(tmp_path):
    """Two processes at EP2 with the default global batch (micro-batch 2 x DP2 = 4) save at step 3; one process
    resumes with no batch flags: it keeps the checkpoint's global batch 4 (two micro-batches, not the one-process
    default 2), so the LR schedule and the losses are those of the uninterrupted two-process run."""
    from layouts_harness import LOSS_RTOL, RESUME_AT, TRAIN, _rel

    at = TRAIN.index("--global-batch-size")
    flags = TRAIN[:at] + TRAIN[at + 2:] + ["--num-workers", "0", "--train-iters", str(STEPS)]
    assert "--global-batch-size" not in flags  # the default: --micro-batch-size 2 x data-parallel size
    both = _run_steps(2, tmp_path / "ep2", flags + ["--ep", "2", "--save", str(tmp_path / "ep2-ckpt"),
                                                     "--save-interval", str(RESUME_AT)])
    one = _run_steps(1, tmp_path / "one", flags + ["--no-save",
                                                    "--load", str(tmp_path / "ep2-ckpt" / f"iter_{RESUME_AT:07d}")])
    log = (tmp_path / "one" / "log.txt").read_text()
    assert "global batch 4 (the checkpoint's; this layout's default would be 2)" in log, log[-3000:]
    assert sorted(one) == list(range(RESUME_AT + 1, STEPS + 1))
    for i in one:
        assert one[i]["learning-rate"] == both[i]["learning-rate"], (i, one[i], both[i])
        assert _rel(one[i]["lm-loss"], both[i]["lm-loss"]) < LOSS_RTOL, (i, one[i]["lm-loss"], both[i]["lm-loss"])
