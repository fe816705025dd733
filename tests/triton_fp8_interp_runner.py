"""Runs megatron_glm5/ops/triton_fp8_gemm.py under Triton's CPU interpreter for tests/test_triton_fp8.py.

Usage: TRITON_INTERPRET=1 python tests/triton_fp8_interp_runner.py CASES.pt RESULTS.pt

Triton 3.6's interpreter gets two things wrong that these kernels depend on, so this process corrects them first
(only here, for this test; compiled kernels never take these paths):
- float conversions to fp8 (and fp32 -> bf16) are done on the bits with a round-half-up of one cut-off bit and no
  carry into the exponent (1.953 -> e4m3 gives 1.0, not 2.0), and fp32 -> bf16 truncates: conversions between float
  types are done by torch instead (round-to-nearest-even, as the GPU's cvt.rn);
- ``tl.dot`` of bf16 operands multiplies their uint16 bit patterns: operands are converted to fp32 first (exact).
"""

import os
import sys

import numpy as np
import torch

_NP_VIEW = {8: np.uint8, 16: np.int16}


def _torch_dtype(tl, dt):
    return {tl.float32: torch.float32, tl.float64: torch.float64, tl.float16: torch.float16,
            tl.bfloat16: torch.bfloat16, tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}[dt]


def patch_interpreter():
    import triton.language as tl
    from triton.runtime import interpreter

    def to_torch(data, dt):
        arr = np.ascontiguousarray(data)
        t = _torch_dtype(tl, dt)
        if dt in (tl.bfloat16, tl.float8e4nv, tl.float8e5):
            return torch.from_numpy(arr.view(_NP_VIEW[dt.primitive_bitwidth]).copy()).view(t)
        return torch.from_numpy(arr.astype(np.dtype(str(t).split(".")[1])))

    def from_torch(t, dt):
        if dt == tl.bfloat16:
            return t.view(torch.int16).numpy().view(np.uint16)
        if dt in (tl.float8e4nv, tl.float8e5):
            return t.view(torch.uint8).numpy()
        return t.numpy()

    def convert(src, dst_type):
        s, d = src.dtype.scalar, dst_type.scalar
        out = from_torch(to_torch(src.data, s).to(_torch_dtype(tl, d)), d).reshape(np.shape(src.data))
        return interpreter.TensorHandle(out, d)

    original_cast = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        s, d = src.dtype.scalar, dst_type.scalar
        if s.is_floating() and d.is_floating():
            return convert(src, dst_type)
        return original_cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        return convert(src, dst_type)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a32 = to_torch(a.data, a.dtype.scalar).to(torch.float32).numpy()
        b32 = to_torch(b.data, b.dtype.scalar).to(torch.float32).numpy()
        return interpreter.TensorHandle(np.matmul(a32, b32, dtype=np.float32) + d.data, d.dtype.scalar)

    B = interpreter.InterpreterBuilder
    B.cast_impl = cast_impl
    for name in ("create_fp_ext", "create_fp_trunc"):
        setattr(B, name, lambda self, src, dst_type: cast_impl(self, src, dst_type))
    B.create_fp_to_fp = create_fp_to_fp
    B.create_dot = create_dot


def run(case):
    from megatron_glm5.ops import triton_fp8_gemm as k

    kind = case["kind"]
    if kind == "quant_blocks":
        return k.fp8_quantize_blocks(case["w"])
    if kind == "quant_rows":
        return k.quantize_rows(case["x"])
    fn = {"fwd": k.fp8_gemm, "dgrad": k.fp8_gemm_dgrad, "gfwd": k.fp8_grouped_gemm,
          "gdgrad": k.fp8_grouped_gemm_dgrad}[kind]
    args = (case["a"], case["q"], case["s"]) + ((case["offsets"],) if kind.startswith("g") else ())
    return {d: fn(*args, design=d, config=case.get("config")) for d in case["designs"]}


def main():
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    from megatron_glm5.ops import triton_interpret_compat

    triton_interpret_compat.apply()
    patch_interpreter()
    cases = torch.load(sys.argv[1])
    torch.save({name: run(c) for name, c in cases.items()}, sys.argv[2])


if __name__ == "__main__":
    main()
