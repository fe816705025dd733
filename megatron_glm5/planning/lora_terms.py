"""The planner's terms for a LoRA run (megatron_glm5/lora/) on a frozen base, bf16 or FP8 (--base-precision fp8).

A frozen base has weights only: no gradient buffer (megatron-core's DDP builds buffers for parameters that require
grad), no fp32 main copy, no Adam moments. Its large matrices in FP8 take 1 byte per element plus one fp32 scale per
128 x 128 block (4 / 16384 bytes per element where the dims divide 128; a partial block, e.g. kv_a's 576 rows,
costs a little more and is not counted); the rest (embedding, output layer, norms, router, the indexer -- our model
keeps its wq_b / wk in the parameter dtype even on an FP8 base, docs/fp8.md --, MTP's eh_proj) keeps the parameter
dtype. The adapters are trained parameters: their weights (parameter dtype), fp32
gradients and the optimizer's state (Adam: 8 bytes of moments, plus a 4-byte fp32 main copy with bf16 parameters),
sharded by the distributed optimizer over dp x cp (dense) or the expert data-parallel group (experts' adapters);
--train-indexer adds the indexers as trained parameters. Padding of the gradient buffers is not modelled (the
adapters are megabytes).
"""
from __future__ import annotations

from typing import Iterable, Sequence

from megatron_glm5.planning.buffers import MAIN_PARAM_BYTES, MOMENT_BYTES, StaticMemory
from megatron_glm5.planning.inventory import KINDS

FP8_SCALE_BYTES_PER_ELEMENT = 4 / (128 * 128)
# the base's weights a frozen FP8 base keeps in FP8 (as the GLM-5-FP8 release does)
FP8_SUFFIXES = ("linear_q_down_proj.weight", "linear_q_up_proj.weight", "linear_kv_down_proj.weight",
                "linear_kv_up_proj.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight",
                "experts.weight1", "experts.weight2")
INDEXER_PART = "core_attention.indexer."


def adapter_elements(cfg, name: str, targets: Iterable[str], rank: int, tp: int = 1, ep: int = 1) -> int:
    """Elements of the adapters on the base weight ``name`` (a planner inventory name) on one rank (0: none)."""
    if not name.startswith("decoder.layers."):
        return 0  # the MTP layer is not adapted
    targets = set(targets)
    h, nh, r = cfg.hidden_size, cfg.num_attention_heads, rank
    col = lambda n_in, n_out: r * n_in + (n_out // tp) * r  # A replicated, B sharded
    row = lambda n_in, n_out: r * (n_in // tp) + n_out * r  # A sharded, B replicated
    shared = cfg.moe_intermediate_size * cfg.n_shared_experts
    e_local = (cfg.n_routed_experts or 0) // ep
    per_name = {
        "self_attention.linear_q_down_proj.weight": ("q_a", lambda: col(h, cfg.q_lora_rank)),
        "self_attention.linear_q_up_proj.weight": ("q_b", lambda: col(cfg.q_lora_rank, nh * cfg.qk_head_dim)),
        "self_attention.linear_kv_down_proj.weight": ("kv_a", lambda: col(h, cfg.kv_lora_rank + cfg.qk_rope_head_dim)),
        "self_attention.linear_kv_up_proj.weight": (
            "kv_b", lambda: col(cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim))),
        "self_attention.linear_proj.weight": ("o", lambda: row(nh * cfg.v_head_dim, h)),
        "mlp.linear_fc1.weight": ("gate_up", lambda: col(h, 2 * cfg.intermediate_size)),
        "mlp.linear_fc2.weight": ("down", lambda: row(cfg.intermediate_size, h)),
        "mlp.shared_experts.linear_fc1.weight": ("shared_gate_up", lambda: col(h, 2 * shared)),
        "mlp.shared_experts.linear_fc2.weight": ("shared_down", lambda: row(shared, h)),
        "mlp.experts.weight1": ("experts_gate_up", lambda: e_local * r * (h + 2 * cfg.moe_intermediate_size)),
        "mlp.experts.weight2": ("experts_down", lambda: e_local * r * (cfg.moe_intermediate_size + h)),
    }
    suffix = name.split(".", 3)[3]  # after decoder.layers.{j}.
    target, count = per_name.get(suffix, (None, None))
    return count() if target in targets else 0


def base_weight_bytes(tensors: Sequence, dtype_bytes: int, fp8: bool) -> int:
    """The frozen base's weights on this rank."""
    total = 0
    for t in tensors:
        if fp8 and t.name.endswith(FP8_SUFFIXES) and not t.name.startswith("mtp.layers.0.eh_proj"):
            total += t.numel + int(round(t.numel * FP8_SCALE_BYTES_PER_ELEMENT))
        else:
            total += t.numel * dtype_bytes
    return total


def lora_static_memory(cfg, tensors: Sequence, lora, *, tp: int, ep: int, dtype_bytes: int, grad_bytes: int,
                       fp8: bool, dense_shards: int, expert_shards: int, distributed_optimizer: bool) -> StaticMemory:
    """Weights, gradients and optimizer state of one rank of a LoRA run holding the base ``tensors``."""
    dense_train = expert_train = adapters = 0
    for t in tensors:
        n = adapter_elements(cfg, t.name, lora.targets, lora.rank, tp, ep)
        adapters += n
        if t.expert:
            expert_train += n
        else:
            dense_train += n
        if lora.train_indexer and INDEXER_PART in t.name:
            dense_train += t.numel  # a base tensor: its weight is in base_weight_bytes already
    trained = dense_train + expert_train
    own_dense = dense_train // dense_shards if distributed_optimizer else dense_train
    own_expert = expert_train // expert_shards if distributed_optimizer else expert_train
    main = MAIN_PARAM_BYTES if dtype_bytes == 2 else 0
    params = {k: sum(t.numel for t in tensors if t.kind == k) for k in KINDS}  # the base's, as the report shows
    return StaticMemory(
        params=params, weight_bytes=base_weight_bytes(tensors, dtype_bytes, fp8) + adapters * dtype_bytes,
        param_bytes=base_weight_bytes(tensors, dtype_bytes, fp8) + adapters * dtype_bytes,
        grad_bytes=trained * grad_bytes, optimizer_main_bytes=(own_dense + own_expert) * main,
        optimizer_moment_bytes=(own_dense + own_expert) * MOMENT_BYTES,
        optimizer_elements={**{k: 0 for k in KINDS}, "dense": own_dense, "experts": own_expert}, optimizer_expert_elements=own_expert,
        buckets=[("lora dense", dense_train), ("lora experts", expert_train)], grad_dtype_bytes=grad_bytes)


def for_rank(args, layout, chunks, static: StaticMemory) -> StaticMemory:
    """``static`` for a LoRA run (args.lora set by arguments.validate_args), else ``static`` unchanged."""
    lora = getattr(args, "lora", None)
    if lora is None:
        return static
    tensors = [t for c in chunks for t in c.tensors]
    return lora_static_memory(
        args.model_config, tensors, lora, tp=layout.tp, ep=layout.ep, dtype_bytes=2 if args.bf16 else 4,
        grad_bytes=static.grad_dtype_bytes, fp8=getattr(args, "base_precision", "bf16") == "fp8",
        dense_shards=layout.dp * layout.cp, expert_shards=layout.edp,
        distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)))
