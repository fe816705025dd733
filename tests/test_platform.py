"""Tests for megatron_glm5.platform and the megatron-core patches it applies (the pre-import and CPU phases of
megatron_glm5/mcore_patches/registry.py, "shims" below): every shim is needed, and works.

Each shim is exercised on the real megatron-core code path in a separate process, twice:
normally (must succeed with the right numbers) and with MEGATRON_GLM5_DISABLE_SHIMS=<shim>
(must fail with the specific error the shim exists for, raised in the expected megatron-core
function).  Importing megatron.core costs ~5 s per interpreter, so the CPU shims' jobs are
forked from one process that has imported it (with the pre-import shims only, as the package
does); the forked children apply the CPU shims themselves.  The pre-import shims' negative
cases need fresh interpreters.  All positive checks share one child, EP=2 runs as two gloo
ranks.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_glm5 import platform as P
from megatron_glm5.mcore_patches import registry
from megatron_glm5.mcore_patches.record import Phase

REPO = Path(__file__).resolve().parents[1]
HAS_TRITON = importlib.util.find_spec("triton") is not None
MAX_PROCS = 2  # concurrent forked children
JOB_TIMEOUT_S = 120

cpu_only = pytest.mark.skipif(P.HAS_CUDA, reason="the CPU shims are no-ops with CUDA")
PRE_IMPORT_SHIMS = registry.names(Phase.PRE_IMPORT)
CPU_SHIMS = registry.names(Phase.CPU)
SHIMS = PRE_IMPORT_SHIMS + CPU_SHIMS

# ---------------------------------------------------------------------------------------
# The checks, run as `python -c CHECKS '<json spec>'` (see the end of the script).  Each
# check returns JSON-able values; failures are reported with exception type, message and the
# (file:function) frames of the traceback.
# ---------------------------------------------------------------------------------------
CHECKS = r'''
import json, os, sys, traceback

_SIZES = []


def setup():
    from megatron_glm5 import platform as P
    if not _SIZES:
        _SIZES.append(P.initialize_model_parallel(seed=1234))
    return _SIZES[0]


def check_import_core():
    import megatron.core  # noqa: F401
    from megatron.core.transformer.moe import paged_stash  # noqa: F401  (imports the stub)
    stub = sys.modules["megatron.core.transformer.moe.ops.paged_stash"]
    try:
        stub.paged_stash_copy_kernel[(1,)]()
        launch = "no error"
    except RuntimeError as e:
        launch = str(e)
    return {"stub": getattr(stub, "__megatron_glm5_stub__", False),
            "block": stub.GLOBAL_BLOCK_SIZE, "launch": launch}


def check_typing_override():
    import typing, typing_extensions
    import megatron.training.models.gpt  # noqa: F401  (`from typing import ..., override`)
    return {"override_is_te": typing.override is typing_extensions.override}


def check_eager_compile():
    import torch
    from megatron.core.transformer.moe import router  # noqa: F401  (@jit_fuser and a bare @torch.compile)
    assert "torch._dynamo" not in sys.modules, "importing megatron.core imported torch._dynamo"
    helper = router.TopKRouter._apply_expert_bias  # @jit_fuser: the function itself, not a compiled wrapper
    return {"fuser_returns_the_function": helper.__code__.co_filename.endswith(os.path.join("moe", "router.py")),
            "compile_is_torchs": (torch.compile.__module__, torch.compile.__qualname__) == ("torch", "compile")}


def check_rng():
    import torch
    from megatron.core import tensor_parallel
    setup()
    tracker = tensor_parallel.get_cuda_rng_tracker()
    ref = lambda seed, n: torch.rand(n, generator=torch.Generator().manual_seed(seed))
    out = {"tracker": type(tracker).__name__}
    # megatron's seeds: model-parallel = seed + 2718 + tp_rank, expert = seed + 1024 + ...
    outer = torch.get_rng_state()
    with tracker.fork():
        mp = torch.rand(3)
    with tracker.fork(tensor_parallel.get_expert_parallel_rng_tracker_name()):
        ex = torch.rand(3)
    out["model_parallel_stream"] = torch.equal(mp, ref(1234 + 2718, 3))
    out["expert_stream"] = torch.equal(ex, ref(1234 + 1024, 3))
    # add + fork, nested fork, continuation of the stream, outer state untouched
    tracker.add("glm5-test", 4321)
    with tracker.fork("glm5-test"):
        a = torch.rand(4)
        with tracker.fork():
            torch.rand(1)
        b = torch.rand(2)
    out["added_stream"] = torch.equal(torch.cat([a, b]), ref(4321, 6))
    out["outer_untouched"] = torch.equal(outer, torch.get_rng_state())
    # activation recomputation restores the RNG states: same dropout mask, same grads
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)

    def f(inp):
        with tracker.fork():
            return torch.nn.functional.dropout(lin(inp), p=0.5, training=True)

    cpu_state = torch.get_rng_state()
    states = {k: v.clone() for k, v in tracker.get_states().items()}
    y = tensor_parallel.checkpoint(f, False, x)
    y.sum().backward()
    g_ckpt = x.grad.clone()
    x.grad = None
    torch.set_rng_state(cpu_state)
    tracker.set_states(states)
    y_ref = f(x)
    y_ref.sum().backward()
    out["recompute_matches"] = torch.equal(y, y_ref) and torch.equal(g_ckpt, x.grad)
    out["dropout_active"] = bool((y_ref == 0).any())
    return out


def check_current_device():
    import torch
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0)  # device=torch.cuda.current_device()
    ref = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    return {"device": str(rope.inv_freq.device), "inv_freq": torch.allclose(rope.inv_freq, ref)}


def _moe_round_trip(ep, rank):
    """alltoall dispatch -> expert e multiplies by (e+1) -> combine; returns (out, expected)."""
    import torch
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    E, T, H, K = 4, 5, 3, 2
    cfg = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=1, num_moe_experts=E,
        moe_router_topk=K, moe_token_dispatcher_type="alltoall",
        expert_model_parallel_size=ep, use_cpu_initialization=True,
    )
    n_local = E // ep
    local = [rank * n_local + i for i in range(n_local)]
    disp = MoEAlltoAllTokenDispatcher(
        n_local, local, cfg, pg_collection=ProcessGroupCollection.use_mpu_process_groups()
    )
    routing = torch.zeros(T, E, dtype=torch.bool)
    for t in range(T):  # two distinct experts per token, different on each rank
        e1 = (t + rank) % E
        routing[t, e1] = True
        routing[t, (e1 + 1 + t % (E - 1)) % E] = True
    hidden = torch.arange(T * H, dtype=torch.float32).view(T, H) + 100 * rank
    x, p = disp.dispatch_preprocess(hidden, routing, routing.float() * 0.5)
    x, p = disp.token_dispatch(x, p)
    x, tokens_per_expert, p = disp.dispatch_postprocess(x, p)
    chunks = torch.split(x, [int(n) for n in tokens_per_expert])
    y = torch.cat([c * (e + 1) for e, c in zip(local, chunks)])
    out = disp.combine_postprocess(disp.token_combine(disp.combine_preprocess(y)))
    expected = hidden * (routing.float() * (torch.arange(E) + 1)).sum(1, keepdim=True)
    return out, expected, [int(n) for n in tokens_per_expert]


def check_streams():
    import torch
    setup()
    out, expected, tpe = _moe_round_trip(ep=1, rank=0)
    return {"tokens_per_expert": tpe, "round_trip": torch.allclose(out, expected)}


def check_ep2():
    import atexit

    import torch
    from megatron_glm5 import platform as P
    from megatron.core import parallel_state as ps
    sizes = P.initialize_model_parallel(ep=2, seed=1234)
    rank = torch.distributed.get_rank()
    res = {"sizes": [sizes.world_size, sizes.ep, sizes.dp, ps.get_expert_model_parallel_world_size()]}
    out, expected, tpe = _moe_round_trip(ep=2, rank=rank)
    res.update(rank=rank, tokens_per_expert=tpe, round_trip=torch.allclose(out, expected))
    # different sizes: destroy + re-init; invalid sizes: clear error, state kept
    sizes = P.initialize_model_parallel(tp=2, seed=1234)
    res["reinit"] = [ps.get_tensor_model_parallel_world_size(),
                     ps.get_expert_model_parallel_world_size(),
                     ps.get_expert_tensor_parallel_world_size(), sizes.dp]
    try:
        P.initialize_model_parallel(tp=3)
        res["invalid"] = "no error"
    except ValueError as e:
        res["invalid"] = str(e)
    res["still_tp2"] = ps.get_tensor_model_parallel_world_size()
    # end_of_job: state and groups torn down at the exit (atexit's functions run here), not before, and not when
    # a job started after it
    P.end_of_job()
    P.initialize_model_parallel(tp=2, seed=1234)
    atexit._run_exitfuncs()
    res["kept_after_a_new_job"] = [ps.model_parallel_is_initialized(), torch.distributed.is_initialized()]
    P.end_of_job()
    P.end_of_job()
    res["kept_until_exit"] = [ps.model_parallel_is_initialized(), torch.distributed.is_initialized()]
    atexit._run_exitfuncs()
    res["destroyed"] = [ps.model_parallel_is_initialized(), torch.distributed.is_initialized()]
    return res


def check_clip():
    import torch
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer.optimizer import FP32Optimizer
    setup()
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0])  # norm 5 > clip_grad 1
    cfg = OptimizerConfig(optimizer="sgd", lr=1.0, clip_grad=1.0)
    opt = FP32Optimizer(torch.optim.SGD([p], lr=1.0), cfg, init_state_fn=None)
    success, grad_norm, _ = opt.step()
    q = torch.nn.Parameter(torch.zeros(2))
    q.grad = torch.tensor([3.0, 4.0])
    clip_grads.clip_grad_by_total_norm_fp32([q], max_norm=10.0, total_norm=5.0)  # below max
    r = torch.nn.Parameter(torch.zeros(2))
    r.grad = torch.tensor([3.0, 4.0])
    clip_grads.clip_grad_by_total_norm_fp32(r, max_norm=2.5, total_norm=torch.tensor(5.0))
    return {"success": success, "grad_norm": grad_norm, "param": p.tolist(),
            "unclipped": q.grad.tolist(), "tensor_norm": r.grad.tolist()}


def check_redirect():
    import torch
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
    from megatron.core.transformer.utils import get_default_causal_mask
    from megatron.core import ModelParallelConfig
    from megatron.core.enums import ModelType
    setup()
    res = {}
    data = {"tokens": torch.arange(6).view(2, 3)}
    got = tensor_parallel.broadcast_data(["tokens"], data, torch.int64)  # device='cuda', .cuda()
    res["broadcast"] = got["tokens"].tolist()
    res["causal_mask"] = get_default_causal_mask(3).int().tolist()  # fused_softmax's mask

    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor(2.0))
            self.config = ModelParallelConfig(pipeline_dtype=torch.float32)
            self.model_type = ModelType.encoder_or_decoder

        def set_input_tensor(self, tensor):
            pass

        def forward(self, x):
            return self.w * x

    model = Scale()

    def forward_step(data_iterator, model):
        x = next(data_iterator)
        return model(x), lambda out: (out.sum(), {"loss": out.sum().detach()})

    batches = iter([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])])
    losses = forward_backward_no_pipelining(  # total_num_tokens device='cuda'
        forward_step_func=forward_step, data_iterator=batches, model=[model],
        num_microbatches=2, seq_length=2, micro_batch_size=1,
    )
    res["losses"] = [float(l["loss"]) for l in losses]
    res["grad_w"] = float(model.w.grad)

    # activation recomputation re-runs forward code inside backward, where torch's autograd
    # engine runs with an empty torch-function-mode stack
    from torch.overrides import _get_current_function_mode_stack

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a.clone()

        @staticmethod
        def backward(ctx, g):
            res["modes_in_backward"] = len(_get_current_function_mode_stack())
            return g

    x = torch.ones(3, 3, requires_grad=True)
    Probe.apply(x).sum().backward()
    masked = lambda inp: inp.masked_fill(get_default_causal_mask(3), 0.0) * 2
    x.grad = None
    tensor_parallel.checkpoint(masked, False, x).sum().backward()
    res["recompute_grad"] = x.grad.int().tolist()
    # narrowness: this script is not megatron code, so its CUDA literals still fail
    for name, fn in (("device_kwarg", lambda: torch.zeros(1, device="cuda")),
                     ("tensor_cuda", lambda: torch.zeros(1).cuda()),
                     ("pin_memory", lambda: torch.zeros(1).pin_memory())):
        try:
            fn()
            res[name] = "redirected"
        except (AssertionError, RuntimeError) as e:
            res[name] = type(e).__name__
    return res


def check_tensor_type():
    import torch
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
    setup()
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.bfloat16))
    cfg = OptimizerConfig(optimizer="sgd", lr=1.0, bf16=True)
    opt = Float16OptimizerWithFloat16Params(torch.optim.SGD([p], lr=1.0), cfg, None, None)
    main = opt.fp32_from_float16_groups[0][0]
    p.grad = torch.tensor([0.5, 0.25], dtype=torch.bfloat16)
    success, _, _ = opt.step()
    return {"main_dtype": str(main.dtype), "success": success, "param": p.float().tolist(),
            "own_type": torch.zeros(1).type()}  # not spoofed outside megatron's optimizer


def check_init():
    import torch
    from megatron_glm5 import platform as P
    from megatron_glm5.mcore_patches import registry
    from megatron.core import parallel_state as ps
    res = {"sizes": list(setup().__dict__.values())}
    group = ps.get_tensor_model_parallel_group()
    applied = list(registry.APPLIED)
    again = P.initialize_model_parallel(seed=1234)
    P.apply_pre_import_shims()
    P.apply_cpu_shims()
    res["same_group"] = ps.get_tensor_model_parallel_group() is group
    res["same_sizes"] = again == setup()
    res["applied_stable"] = registry.APPLIED == applied
    res["applied"] = applied
    try:
        P.initialize_model_parallel(ep=2)
        res["invalid"] = "no error"
    except ValueError as e:
        res["invalid"] = str(e)
    res["still_initialized"] = ps.model_parallel_is_initialized()
    P.destroy_model_parallel()
    res["destroyed"] = [ps.model_parallel_is_initialized(), torch.distributed.is_initialized()]
    P.initialize_model_parallel(seed=7)
    res["reseeded"] = torch.equal(torch.rand(3), torch.rand(3, generator=torch.Generator().manual_seed(7)))
    res["reinitialized"] = ps.model_parallel_is_initialized() and torch.distributed.get_world_size() == 1
    P.destroy_model_parallel()
    return res


def boot():
    """What the project's entry points do: import the package (applies the pre-import shims)."""
    from megatron_glm5 import platform as P
    P.apply_pre_import_shims()


def run_checks(names):
    results = {}
    for name in names:
        try:
            boot()
            results[name] = {"ok": True, "value": globals()["check_" + name]()}
        except BaseException as e:  # report, keep going
            results[name] = {
                "ok": False,
                "type": type(e).__name__,
                "message": str(e)[:3000],
                "frames": [os.path.basename(f.filename) + ":" + f.name
                           for f in traceback.extract_tb(e.__traceback__)],
            }
    return results


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fork_jobs(jobs, max_procs, timeout):
    """Fork-server: import megatron.core once (pre-import shims only, as in production), then
    run each job in forked children, which apply the CPU shims themselves (minus `disable`).
    A job with nprocs=2 runs two ranks of a gloo group (env:// rendezvous)."""
    import shutil, signal, tempfile, time
    boot()
    import megatron.core  # noqa: F401  (the expensive part, shared by all children)
    tmp = tempfile.mkdtemp()
    pending, running, out = list(jobs), {}, {}
    while pending or running:
        while pending and len(running) + pending[0]["nprocs"] <= max_procs:
            job = pending.pop(0)
            port = free_port()
            for rank in range(job["nprocs"]):
                path = os.path.join(tmp, f"{job['name']}.{rank}.json".replace(":", "_"))
                sys.stdout.flush()
                pid = os.fork()
                if pid == 0:  # child
                    try:
                        os.environ.pop("MEGATRON_GLM5_DISABLE_SHIMS", None)
                        if job["disable"]:
                            os.environ["MEGATRON_GLM5_DISABLE_SHIMS"] = job["disable"]
                        if job["nprocs"] > 1:
                            os.environ.update(WORLD_SIZE=str(job["nprocs"]), RANK=str(rank),
                                              LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                                              MASTER_PORT=str(port))
                        res = run_checks(job["checks"])
                        with open(path, "w") as f:
                            json.dump(res, f)
                    finally:
                        sys.stdout.flush()
                        os._exit(0)
                running[pid] = (job["name"], rank, path, time.monotonic())
        for pid, (name, rank, path, start) in list(running.items()):
            done, _ = os.waitpid(pid, os.WNOHANG)
            if not done and time.monotonic() - start > timeout:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                done = pid
            if done:
                del running[pid]
                res = None
                if os.path.exists(path):
                    with open(path) as f:
                        res = json.load(f)
                out.setdefault(name, {})[rank] = res
        time.sleep(0.02)
    shutil.rmtree(tmp, ignore_errors=True)
    return {name: [ranks.get(r) for r in range(len(ranks))] for name, ranks in out.items()}


spec = json.loads(sys.argv[1])
if spec["mode"] == "fork":
    results = fork_jobs(spec["jobs"], spec["max_procs"], spec["timeout"])
else:  # a fresh process (the pre-import shims' negative cases)
    results = {spec["job"]: [run_checks(spec["checks"])]}
print("@@RESULTS@@" + json.dumps(results), flush=True)
'''

# Positive checks that share one process (order matters: init tears down at the end).
POSITIVE = [
    "import_core", "typing_override", "eager_compile", "rng", "current_device", "streams",
    "clip", "redirect", "tensor_type", "init",
]

# shim -> (check, exception type, message fragment, frame "file:function" raising it)
NEGATIVE = {
    "triton_free_paged_stash": (
        "import_core", "ModuleNotFoundError", "No module named 'triton'", "paged_stash.py:<module>"),
    "typing_override": (
        "typing_override", "ImportError", "cannot import name 'override' from 'typing'",
        "hybrid.py:<module>"),
    "cpu_eager_compile": (
        "eager_compile", "AssertionError", "importing megatron.core imported torch._dynamo",
        "<string>:check_eager_compile"),
    "cpu_rng_tracker": (
        "rng", "AssertionError", "Torch not compiled with CUDA enabled", "random.py:add"),
    "cuda_current_device": (
        "current_device", "AssertionError", "Torch not compiled with CUDA enabled",
        "rotary_pos_embedding.py:__init__"),
    "cuda_streams": (
        "streams", "RuntimeError", "torch.cuda.Stream requires CUDA support",
        "token_dispatcher.py:__init__"),
    "clip_grad_cpu": (
        "clip", "AssertionError", "", "clip_grads.py:clip_grad_by_total_norm_fp32"),
    "moe_split_sizes_numpy": (
        "ep2", "TypeError", "all_to_all_single(): incompatible function arguments",
        "mappings.py:forward"),
    "cuda_device_redirect": (
        "redirect", "AssertionError", "Torch not compiled with CUDA enabled",
        "data.py:_build_key_size_numel_dictionaries"),
    "cuda_tensor_type": (
        "tensor_type", "TypeError",
        "Wrapped parameters must be one of torch.cuda.FloatTensor", "optimizer.py:__init__"),
}
TWO_PROCESS_CHECKS = {"ep2"}
SKIP_NEGATIVE = {
    "typing_override": "typing.override exists" if sys.version_info >= (3, 12) else None,
}


def _env(disable=None):
    env = dict(os.environ)
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", registry.DISABLE_ENV):
        env.pop(k, None)
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    if disable:
        env[registry.DISABLE_ENV] = disable
    return env


# Where triton is installed (the test extra brings it for the kernel interpreter tests), the child interpreters that
# check the triton shim get a finder that makes ``import triton`` fail as on a machine without it.
HIDE_TRITON = """
import importlib.abc as _abc, sys as _sys
class _NoTriton(_abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
_sys.meta_path.insert(0, _NoTriton())
"""


def _launch(spec, disable=None):
    code = (HIDE_TRITON if spec.get("hide_triton") else "") + CHECKS
    return subprocess.Popen(
        [sys.executable, "-c", code, json.dumps(spec)], cwd=REPO, env=_env(disable),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


@pytest.fixture(scope="module")
def runs():
    """Run every job; name -> one {check: result} dict (or None if it crashed) per process.

    CPU shims: forked from one process that imported megatron.core (see fork_jobs).
    Pre-import shims: their negative cases need a fresh interpreter each.
    """
    forked = [dict(name="positive", checks=POSITIVE, disable="", nprocs=1),
              dict(name="ep2", checks=["ep2"], disable="", nprocs=2)]
    fresh = {}
    for shim, (check, *_rest) in NEGATIVE.items():
        if SKIP_NEGATIVE.get(shim):
            continue
        if shim in PRE_IMPORT_SHIMS:
            fresh["neg:" + shim] = _launch(dict(mode="fresh", job="neg:" + shim, checks=[check],
                                                hide_triton=shim == "triton_free_paged_stash"), disable=shim)
        else:
            nprocs = 2 if check in TWO_PROCESS_CHECKS else 1
            forked.append(dict(name="neg:" + shim, checks=[check], disable=shim, nprocs=nprocs))
    if HAS_TRITON:  # the stub's own positive check, in an interpreter where triton cannot be imported
        fresh["no_triton"] = _launch(dict(mode="fresh", job="no_triton", checks=["import_core"], hide_triton=True))
    procs = [_launch(dict(mode="fork", jobs=forked, max_procs=MAX_PROCS, timeout=JOB_TIMEOUT_S))]
    procs += fresh.values()
    results, logs = {}, []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=JOB_TIMEOUT_S * 2)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        logs.append(out)
        for line in out.splitlines():
            if line.startswith("@@RESULTS@@"):
                results.update(json.loads(line[len("@@RESULTS@@"):]))
    results["_logs"] = logs
    return results


def _result(runs, job, check, proc=0):
    log = "\n".join(entry[-3000:] for entry in runs["_logs"])
    assert job in runs and runs[job][proc] is not None, f"job {job} rank {proc} crashed:\n{log}"
    return runs[job][proc][check]


def _value(runs, job, check, proc=0):
    res = _result(runs, job, check, proc)
    assert res["ok"], f"{check} failed in {job}: {res['type']}: {res['message']}\n{res['frames']}"
    return res["value"]


# ------------------------------- registry (in-process) ----------------------------------


def test_registry_order_and_phases():
    assert list(registry.PATCHES)[:len(SHIMS)] == list(PRE_IMPORT_SHIMS) + list(CPU_SHIMS)
    assert PRE_IMPORT_SHIMS == ("triton_free_paged_stash", "typing_override", "cpu_eager_compile")
    # every shim has a negative test, and every shim documents itself
    assert set(NEGATIVE) == set(SHIMS)
    for fn in (registry.PATCHES[name].apply for name in SHIMS):  # each names the megatron-core file that needs it
        assert fn.__doc__ and "megatron" in fn.__doc__ and ".py" in fn.__doc__, fn


def test_disable_env_rejects_unknown_names(monkeypatch):
    monkeypatch.setenv(registry.DISABLE_ENV, "cuda_streams, typo_shim")
    with pytest.raises(ValueError, match="typo_shim"):
        registry.disabled()
    monkeypatch.setenv(registry.DISABLE_ENV, " cuda_streams ,clip_grad_cpu,")
    assert registry.disabled() == {"cuda_streams", "clip_grad_cpu"}


def test_no_megatron_import_and_cpu_shims_noop_with_cuda():
    """platform.py imports megatron.core only inside functions; with CUDA, apply_cpu_shims
    applies only the pre-import shims (CUDA faked here by patching is_available first)."""
    code = (
        "import json, sys, torch\n"
        "torch.cuda.is_available = lambda: True\n"
        "current_device = torch.cuda.current_device\n"
        "from megatron_glm5 import platform as P\n"
        "core = 'megatron.core' in sys.modules\n"
        "applied = P.apply_cpu_shims()\n"
        "print(json.dumps([core, 'megatron.core' in sys.modules, P.HAS_CUDA, applied,\n"
        "                  torch.cuda.current_device is current_device]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(),
                         capture_output=True, text=True, check=True)
    core_at_import, core_after, has_cuda, applied, untouched = json.loads(out.stdout)
    assert (core_at_import, core_after, has_cuda, untouched) == (False, False, True, True)
    assert set(applied) <= set(PRE_IMPORT_SHIMS)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tp=3), "--tp 3 does not divide world size 1"),
        (dict(ep=2), "--ep 2 does not divide world size 1"),
        (dict(tp=0), "--tp must be a positive integer, got 0"),
        (dict(cp=1.5), "--cp must be a positive integer, got 1.5"),
        (dict(etp=2), "--etp 2 does not divide world size 1"),
        (dict(vpp=2), "--vpp 2 needs --pp > 1"),
    ],
)
def test_invalid_sizes_raise_before_initializing(kwargs, message):
    import torch.distributed as dist

    before = dist.is_initialized()  # other test modules may have initialized (world size 1)
    if before:
        assert dist.get_world_size() == 1
    with pytest.raises(ValueError, match=message.replace("+", r"\+").replace(".", r"\.")):
        P.initialize_model_parallel(**kwargs)
    assert dist.is_initialized() == before


def test_product_validation_names_the_flags():
    with pytest.raises(ValueError, match=r"--tp 2 x --pp 2 x --cp 1 = 4 does not divide world size 2"):
        P._validate_sizes(2, tp=2, pp=2, ep=1, etp=None, cp=1, vpp=None)
    with pytest.raises(ValueError, match=r"--etp 2 x --ep 2 x --pp 1 = 4 does not divide world size 2"):
        P._validate_sizes(2, tp=1, pp=1, ep=2, etp=2, cp=1, vpp=None)
    sizes = P._validate_sizes(8, tp=2, pp=2, ep=4, etp=1, cp=1, vpp=2)
    assert (sizes.dp, sizes.etp, sizes.vpp) == (2, 1, 2)


# ------------------------------- positive (subprocesses) --------------------------------


@cpu_only
def test_import_megatron_core_uses_paged_stash_stub(runs):
    v = _value(runs, "no_triton" if HAS_TRITON else "positive", "import_core")
    assert v["stub"] is True and v["block"] == 1024
    assert "needs triton" in v["launch"]


@cpu_only
def test_typing_override_lets_megatron_training_import(runs):
    assert _value(runs, "positive", "typing_override") == {"override_is_te": True}


@cpu_only
def test_megatron_core_fusers_run_eagerly_on_cpu(runs):
    """Without CUDA, importing megatron.core compiles nothing: its @jit_fuser helpers are the functions themselves;
    torch.compile itself (outside megatron.core) is torch's."""
    assert _value(runs, "positive", "eager_compile") == {"fuser_returns_the_function": True,
                                                         "compile_is_torchs": True}


@cpu_only
def test_cpu_rng_tracker_streams(runs):
    v = _value(runs, "positive", "rng")
    assert v == {
        "tracker": "CpuRNGStatesTracker",
        "model_parallel_stream": True,
        "expert_stream": True,
        "added_stream": True,
        "outer_untouched": True,
        "recompute_matches": True,
        "dropout_active": True,
    }


@cpu_only
def test_current_device_is_cpu(runs):
    assert _value(runs, "positive", "current_device") == {"device": "cpu", "inv_freq": True}


@cpu_only
def test_alltoall_dispatcher_round_trip_ep1(runs):
    v = _value(runs, "positive", "streams")
    # tokens t on rank 0 go to experts t%4 and (t%4 + 1 + t%3)%4
    assert v == {"tokens_per_expert": [3, 3, 2, 2], "round_trip": True}


@cpu_only
def test_alltoall_dispatcher_round_trip_ep2(runs):
    for rank in range(2):
        v = _value(runs, "ep2", "ep2", proc=rank)
        assert v["rank"] == rank
        assert v["sizes"] == [2, 2, 2, 2]  # world, ep, dp, megatron's EP size
        assert v["round_trip"] is True
        assert v["reinit"] == [2, 1, 2, 1]  # tp, ep, etp (= tp), dp after re-init with tp=2
        assert v["invalid"] == "--tp 3 does not divide world size 2"
        assert v["still_tp2"] == 2
        assert v["kept_after_a_new_job"] == [True, True]
        assert v["kept_until_exit"] == [True, True]
        assert v["destroyed"] == [False, False]
    # both ranks' tokens: rank r routes token t to (t+r)%4 and that + 1 + t%3
    # experts 0..3 get 3+2, 3+3, 2+3, 2+2 tokens; rank 0 holds experts 0-1, rank 1 2-3
    assert _value(runs, "ep2", "ep2", 0)["tokens_per_expert"] == [5, 6]
    assert _value(runs, "ep2", "ep2", 1)["tokens_per_expert"] == [5, 4]


@cpu_only
def test_optimizer_step_clips_grads(runs):
    v = _value(runs, "positive", "clip")
    assert v["success"] is True
    assert v["grad_norm"] == pytest.approx(5.0)
    assert v["param"] == pytest.approx([-0.6, -0.8], rel=1e-5)  # SGD lr=1 on grad * 1/5
    assert v["unclipped"] == [3.0, 4.0]
    assert v["tensor_norm"] == pytest.approx([1.5, 2.0], rel=1e-5)


@cpu_only
def test_cuda_literals_redirected_for_megatron_only(runs):
    v = _value(runs, "positive", "redirect")
    assert v["broadcast"] == [[0, 1, 2], [3, 4, 5]]
    assert v["causal_mask"] == [[0, 1, 1], [0, 0, 1], [0, 0, 0]]
    assert v["losses"] == [6.0, 14.0]  # w=2: sum(2x) per microbatch
    assert v["grad_w"] == pytest.approx((3.0 + 7.0) / 2)  # d/dw, averaged over 2 microbatches
    assert v["modes_in_backward"] == 0
    assert v["recompute_grad"] == [[2, 0, 0], [2, 2, 0], [2, 2, 2]]
    assert v["device_kwarg"] == "AssertionError"
    assert v["tensor_cuda"] == "AssertionError"
    assert v["pin_memory"] == "RuntimeError"


@cpu_only
def test_float16_optimizer_accepts_cpu_bf16_params(runs):
    v = _value(runs, "positive", "tensor_type")
    assert v == {"main_dtype": "torch.float32", "success": True, "param": [0.5, 1.75],
                 "own_type": "torch.FloatTensor"}


@cpu_only
def test_initialize_model_parallel_single_process(runs):
    v = _value(runs, "positive", "init")
    assert v["sizes"] == [1, 1, 1, 1, 1, None, 1, 1]
    assert v["same_group"] and v["same_sizes"] and v["applied_stable"]
    expected = [s for s in SHIMS if not (s == "triton_free_paged_stash" and HAS_TRITON)
                and not (s == "typing_override" and sys.version_info >= (3, 12))]
    assert v["applied"] == expected
    assert v["invalid"] == "--ep 2 does not divide world size 1"
    assert v["still_initialized"] is True
    assert v["destroyed"] == [False, False]
    assert v["reseeded"] and v["reinitialized"]


# ------------------------------- negative (subprocesses) --------------------------------


@cpu_only
@pytest.mark.parametrize("shim", list(NEGATIVE))
def test_shim_is_needed(runs, shim):
    if SKIP_NEGATIVE.get(shim):
        pytest.skip(SKIP_NEGATIVE[shim])
    check, exc_type, fragment, frame = NEGATIVE[shim]
    nprocs = 2 if check in TWO_PROCESS_CHECKS else 1
    for proc in range(nprocs):
        res = _result(runs, "neg:" + shim, check, proc)
        assert not res["ok"], f"{check} passed with {shim} disabled: {res.get('value')}"
        assert res["type"] == exc_type, res
        assert fragment in res["message"], res
        assert frame in res["frames"], res
