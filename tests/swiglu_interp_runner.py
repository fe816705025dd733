"""Runs the Triton SwiGLU (megatron_glm5/ops/triton_swiglu.py) under TRITON_INTERPRET=1 (CPU) for
tests/test_swiglu.py: forward and backward of each case, with a column block smaller than the rows so that every
row's program loops. Usage: python tests/swiglu_interp_runner.py CASES.pt RESULTS.pt"""

import os
import sys

import torch


def main(cases_path, results_path):
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    from megatron_glm5.ops import triton_swiglu

    cases = torch.load(cases_path)
    results = {}
    for name, c in cases.items():
        triton_swiglu.SWIGLU_CONFIG["BLOCK"] = c["block"]
        y = c["y"].clone().requires_grad_()
        w = None if c["w"] is None else c["w"].clone().requires_grad_()
        view = y[:, : c["cols"]] if c.get("strided") else y  # rows strided: a column slice of a wider tensor
        out = triton_swiglu.swiglu(view, w)
        out.backward(c["g"])
        results[name] = dict(out=out.detach(), dy=y.grad, dw=None if w is None else w.grad)
    torch.save(results, results_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
