"""Does keeping the kv rows in L2 speed up our sparse forward at long sequences? An experiment (issue 16).

Our TileLang forward gathers top-k kv rows (576 bf16 = 1,152 B each) from all of kv for every query; at S 32768 kv
is 37.7 MB against the H100's 50 MB L2, shared with the streamed q and outputs.  This times the forward with and
without a CUDA access-policy window that marks kv "persisting" in L2 (cudaStreamSetAttribute on torch's current
stream, cudaLimitPersistingL2CacheSize at the device's maximum), same inputs, same run, CUDA events after warm-up,
median; prints one JSON line.  Reached through the CUDA runtime with ctypes (torch exposes no access-policy window).

    python3 benchmarks/l2_persistence.py --seqs 16384 32768 --reps 10
"""
from __future__ import annotations

import argparse
import ctypes
import json
import sys

import torch

from dsa_kernels import Problem, timed  # benchmarks/, the script's folder

ACCESS_POLICY_WINDOW = 1  # cudaStreamAttributeAccessPolicyWindow (= cudaLaunchAttributeAccessPolicyWindow)
LIMIT_PERSISTING_L2 = 0x06  # cudaLimitPersistingL2CacheSize
ATTR_MAX_PERSISTING_L2 = 108  # cudaDevAttrMaxPersistingL2CacheSize
ATTR_MAX_WINDOW = 109  # cudaDevAttrMaxAccessPolicyWindowSize
NORMAL, STREAMING, PERSISTING = 0, 1, 2  # cudaAccessProperty


class _Window(ctypes.Structure):
    _fields_ = [("base_ptr", ctypes.c_void_p), ("num_bytes", ctypes.c_size_t), ("hitRatio", ctypes.c_float),
                ("hitProp", ctypes.c_int), ("missProp", ctypes.c_int)]


class _AttrValue(ctypes.Union):  # cudaStreamAttrValue / cudaLaunchAttributeValue: 64 bytes
    _fields_ = [("accessPolicyWindow", _Window), ("pad", ctypes.c_char * 64)]


def cudart():
    """The CUDA runtime library torch loaded (found in this process's mappings)."""
    torch.cuda.init()
    with open("/proc/self/maps") as f:
        paths = sorted({line.split()[-1] for line in f if "libcudart.so" in line})
    if not paths:
        raise RuntimeError("libcudart is not loaded in this process")
    return ctypes.CDLL(paths[0])


def _check(rt, code, what):
    if code != 0:
        rt.cudaGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"{what}: {rt.cudaGetErrorString(code).decode()}")


def device_attr(rt, attr) -> int:
    v = ctypes.c_int(0)
    _check(rt, rt.cudaDeviceGetAttribute(ctypes.byref(v), attr, torch.cuda.current_device()), "cudaDeviceGetAttribute")
    return v.value


def set_window(rt, tensor, hit_ratio: float):
    """Mark ``tensor``'s bytes persisting in L2 for kernels on torch's current stream (hit_ratio 0: remove)."""
    val = _AttrValue()
    w = val.accessPolicyWindow
    if hit_ratio > 0:
        w.base_ptr = tensor.data_ptr()
        w.num_bytes = min(tensor.numel() * tensor.element_size(), device_attr(rt, ATTR_MAX_WINDOW))
        w.hitRatio, w.hitProp, w.missProp = hit_ratio, PERSISTING, STREAMING
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    rt.cudaStreamSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(_AttrValue)]
    _check(rt, rt.cudaStreamSetAttribute(stream, ACCESS_POLICY_WINDOW, ctypes.byref(val)), "cudaStreamSetAttribute")
    if hit_ratio == 0:
        _check(rt, rt.cudaCtxResetPersistingL2Cache(), "cudaCtxResetPersistingL2Cache")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[32768])
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    from megatron_glm5.ops import tilelang_sparse_mla_ws as tlws

    rt = cudart()
    max_persist = device_attr(rt, ATTR_MAX_PERSISTING_L2)
    rt.cudaDeviceSetLimit.argtypes = [ctypes.c_int, ctypes.c_size_t]
    _check(rt, rt.cudaDeviceSetLimit(LIMIT_PERSISTING_L2, max_persist), "cudaDeviceSetLimit")
    res = {"device": torch.cuda.get_device_name(), "max_persisting_l2": max_persist,
           "max_window": device_attr(rt, ATTR_MAX_WINDOW)}
    for seq in args.seqs:
        p = Problem(seq)

        def fwd():
            return tlws.tilelang_sparse_fwd_ws(p.q, p.kv, p.indices, p.scale, 512)

        fwd()  # compiled outside the timing
        row = {"kv_bytes": p.kv.numel() * 2}
        for name, ratio in (("none", 0.0), ("kv_persisting", 1.0), ("kv_persisting_0.6", 0.6), ("none_again", 0.0)):
            set_window(rt, p.kv, ratio)
            ms = timed(fwd, p.refill, args.reps)
            row[f"{name}_ms"] = ms
            row[f"{name}_tflops"] = p.fwd_flop / ms / 1e9
        set_window(rt, p.kv, 0.0)
        res[str(seq)] = row
        print(json.dumps({seq: row}), flush=True)
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
