"""The names users give --lora-target-modules, and the modules of a GLM-5 decoder layer they adapt.

Per layer (megatron module path relative to ``decoder.layers.{i}.``; HF module of GlmMoeDsaForCausalLM):

  q_a             self_attention.linear_q_down_proj    self_attn.q_a_proj
  q_b             self_attention.linear_q_up_proj      self_attn.q_b_proj
  kv_a            self_attention.linear_kv_down_proj   self_attn.kv_a_proj_with_mqa
  kv_b            self_attention.linear_kv_up_proj     self_attn.kv_b_proj
  o               self_attention.linear_proj           self_attn.o_proj
  gate_up         mlp.linear_fc1 (dense layers)        mlp.gate_proj + mlp.up_proj (one A, B split by rows)
  down            mlp.linear_fc2 (dense layers)        mlp.down_proj
  shared_gate_up  mlp.shared_experts.linear_fc1        mlp.shared_experts.gate_proj + up_proj
  shared_down     mlp.shared_experts.linear_fc2        mlp.shared_experts.down_proj
  experts_gate_up mlp.experts (fc1 of every expert)    mlp.experts.gate_up_proj (3-D, PEFT target_parameters)
  experts_down    mlp.experts (fc2 of every expert)    mlp.experts.down_proj

Groups: attention = q_a q_b kv_a kv_b o; mlp = gate_up down; shared_experts = shared_gate_up shared_down;
experts = experts_gate_up experts_down; all = everything. HF's attention names (q_a_proj, q_b_proj,
kv_a_proj_with_mqa, kv_b_proj, o_proj) are accepted as aliases. Only the main decoder's layers are adapted: the
MTP layer stays frozen (transformers' GlmMoeDsaForCausalLM has no MTP layer to carry its adapters).
"""
from __future__ import annotations

from typing import Dict, Iterable, Tuple

# canonical name -> (megatron module suffix within a layer, kind); kind: column | row | experts_fc1 | experts_fc2
TARGETS: Dict[str, Tuple[str, str]] = {
    "q_a": ("self_attention.linear_q_down_proj", "column"),
    "q_b": ("self_attention.linear_q_up_proj", "column"),
    "kv_a": ("self_attention.linear_kv_down_proj", "column"),
    "kv_b": ("self_attention.linear_kv_up_proj", "column"),
    "o": ("self_attention.linear_proj", "row"),
    "gate_up": ("mlp.linear_fc1", "column"),
    "down": ("mlp.linear_fc2", "row"),
    "shared_gate_up": ("mlp.shared_experts.linear_fc1", "column"),
    "shared_down": ("mlp.shared_experts.linear_fc2", "row"),
    "experts_gate_up": ("mlp.experts", "experts_fc1"),
    "experts_down": ("mlp.experts", "experts_fc2"),
}
GROUPS: Dict[str, Tuple[str, ...]] = {
    "attention": ("q_a", "q_b", "kv_a", "kv_b", "o"),
    "mlp": ("gate_up", "down"),
    "shared_experts": ("shared_gate_up", "shared_down"),
    "experts": ("experts_gate_up", "experts_down"),
    "all": tuple(TARGETS),
}
HF_ALIASES: Dict[str, str] = {"q_a_proj": "q_a", "q_b_proj": "q_b", "kv_a_proj_with_mqa": "kv_a",
                              "kv_b_proj": "kv_b", "o_proj": "o"}
DEFAULT_TARGETS = "all"
DECODER_PREFIX = "decoder.layers."


def valid_names() -> list:
    return list(GROUPS) + list(TARGETS) + list(HF_ALIASES)


def resolve(names: Iterable[str]) -> Tuple[str, ...]:
    """Canonical target names of the user's list (groups expanded, aliases mapped), sorted. Raises KeyError with
    the first unknown name."""
    out = set()
    for name in names:
        name = name.strip()
        if not name:
            continue
        if name in GROUPS:
            out.update(GROUPS[name])
        elif name in TARGETS:
            out.add(name)
        elif name in HF_ALIASES:
            out.add(HF_ALIASES[name])
        else:
            raise KeyError(name)
    return tuple(sorted(out))


def match(module_name: str, targets: Iterable[str]):
    """The target names (a module may carry two: the experts' fc1 and fc2) that adapt the module named
    ``module_name`` (a megatron module path of a model chunk), or () for none."""
    if not module_name.startswith(DECODER_PREFIX):
        return ()
    rest = module_name[len(DECODER_PREFIX):].split(".", 1)
    if len(rest) != 2 or not rest[0].isdigit():
        return ()
    return tuple(t for t in targets if TARGETS[t][0] == rest[1])
