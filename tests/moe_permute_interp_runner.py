"""Runs the fused MoE permute/unpermute (megatron_glm5/ops/triton_moe_permute.py) under TRITON_INTERPRET=1 (CPU)
for tests/test_moe_permute.py.

Usage: python tests/moe_permute_interp_runner.py CASES.pt RESULTS.pt
``pipeline`` is shared with the test, which runs it with megatron-core's unfused functions; ``tiny_layer_run`` is
the end-to-end tiny GLM-5 model (fused and unfused dispatchers, same weights and input).
A separate process because the interpreter must be chosen before triton is first imported.
"""

import os
import sys

import torch


def pipeline(case, permute, unpermute):
    """permute -> a per-slot nonlinear function of the rows and permuted probs -> unpermute -> loss; returns the
    forward results and the gradients of tokens and probs."""
    x = case["tokens"].clone().requires_grad_()
    probs = case["probs"].clone().requires_grad_()
    rows, pprobs, sorted_indices, _, _ = permute(x, case["routing_map"], probs=probs,
                                                 num_out_tokens=case["num_out"])
    y = rows * pprobs.unsqueeze(-1).to(rows.dtype) + 0.5 * rows * rows
    out = unpermute(y, sorted_indices, x.shape)
    (out.float() * case["grad_out"]).sum().backward()
    token_of_row = sorted_indices.slot_token if hasattr(sorted_indices, "slot_token") else sorted_indices
    return dict(rows=rows.detach(), pprobs=pprobs.detach(), sorted_indices=token_of_row, out=out.detach(),
                grad_tokens=x.grad, grad_probs=probs.grad)


def tiny_layer_run(dispatcher: str, fused: bool):
    """A 2-layer tiny GLM-5 (layer 1: MoE, 8 experts top-2), one forward + backward; loss, logits and every
    gradient, and the MoE layer's dispatcher class."""
    import megatron_glm5
    from megatron_glm5 import GLM5Config, build_model

    megatron_glm5.initialize_model_parallel(seed=3)
    cfg = GLM5Config.from_preset("tiny").replace(num_hidden_layers=2)
    model = build_model(cfg, mtp=False, moe_token_dispatcher_type=dispatcher, moe_triton_permute_fusion=fused)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(5))
    logits = model(ids)
    loss = logits.float().pow(2).mean()
    loss.backward()
    return dict(loss=loss.detach(), logits=logits.detach(),
                grads={n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
                dispatcher=type(model.decoder.layers[1].mlp.token_dispatcher).__name__)


def main(cases_path, results_path):
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    from megatron_glm5.ops import triton_moe_permute as fused

    cases = torch.load(cases_path)
    results = {name: pipeline(c, fused.permute, fused.unpermute) for name, c in cases["kernels"].items()}
    results["tiny"] = {(d, f): tiny_layer_run(d, f) for d in cases["dispatchers"] for f in (False, True)}
    torch.save(results, results_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
