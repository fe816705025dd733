"""The planner knows the memory options: --grad-reduce-dtype bf16 and --optimizer-cpu-offload (fraction F).

Hand-computed bytes on a two-buffer rank (dense: 1000 + 300 elements, experts: 5000; bf16 parameters, no
distributed optimizer so that nothing is padded), then the seed recipe's verdicts on an H100 with each option.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "examples" / "recipes" / "glm5.3_sft_32x8.yaml"


def _static(**options):
    from megatron_glm5.planning.buffers import Buffer, buffer_layout, static_memory
    from megatron_glm5.planning.inventory import Tensor

    dense = buffer_layout([Tensor("a", 1000, "dense"), Tensor("b", 300, "dense")], None, 1, False)
    expert = buffer_layout([Tensor("e", 5000, "experts", expert=True)], None, 1, False)
    buffers = [Buffer(0, False, dense, 1), Buffer(0, True, expert, 1)]
    return static_memory(buffers, dense_index=0, expert_index=0, bf16=True, distributed_optimizer=False, **options)


def test_default_bytes():
    from megatron_glm5.planning.memory import optimizer_step_transient_bytes

    s = _static()
    assert (s.weight_bytes, s.grad_bytes) == (6300 * 2, 6300 * 4)
    assert (s.optimizer_main_bytes, s.optimizer_moment_bytes, s.host_optimizer_bytes) == (6300 * 4, 6300 * 8, 0)
    assert optimizer_step_transient_bytes(s) == 4 * 5000  # torch AdamW foreach: the larger optimizer (experts)


def test_bf16_gradient_reduction_bytes():
    from megatron_glm5.planning.memory import optimizer_step_transient_bytes

    s = _static(grad_bytes=2)
    assert s.grad_bytes == 12600  # 6300 x 2
    assert s.optimizer_main_bytes + s.optimizer_moment_bytes == 75600  # unchanged: 6300 x 12
    # the foreach temporary (4 x 5000) + the fp32 copies of every owned gradient megatron-core hands Adam (4 x 6300)
    assert optimizer_step_transient_bytes(s) == 45200


def test_cpu_offload_bytes():
    from megatron_glm5.planning.memory import optimizer_step_transient_bytes

    half = _static(offload_fraction=0.5)
    assert half.gpu_optimizer_elements() == (650, 2500)
    assert half.optimizer_main_bytes == 3150 * 4 and half.optimizer_moment_bytes == 3150 * 8
    assert half.host_optimizer_bytes == 50400  # 3150 offloaded x (4 master + 8 moments + 4 gradient copy)
    assert optimizer_step_transient_bytes(half) == 10000  # foreach over the 2500 expert elements left on the GPU
    full = _static(offload_fraction=1.0, grad_bytes=2)
    assert (full.optimizer_main_bytes, full.optimizer_moment_bytes, full.host_optimizer_bytes) == (0, 0, 100800)
    assert full.grad_bytes == 12600
    assert optimizer_step_transient_bytes(full) == 0  # nothing steps on the GPU


def test_cpu_offload_step_time():
    from types import SimpleNamespace

    from megatron_glm5.planning.gpus import get_gpu
    from megatron_glm5.planning.step_time import optimizer_step_s

    h100 = get_gpu("h100-80gb")  # PCIe 64 GB/s per direction, host memory 77 GB/s per GPU
    half = _static(offload_fraction=0.5)
    on_gpu = 3150 * 1e-9  # 1 ns per GPU-resident element, given
    pcie, cpu = 3150 * 8 / 64e9, 3150 * 28 / 77e9
    assert optimizer_step_s(half, h100, 1e-9, SimpleNamespace()) == pytest.approx(max(on_gpu, pcie + cpu))
    overlap = SimpleNamespace(overlap_cpu_optimizer_d2h_h2d=True)
    assert optimizer_step_s(half, h100, 1e-9, overlap) == pytest.approx(max(on_gpu, cpu))
    assert optimizer_step_s(_static(), h100, 1e-9, SimpleNamespace()) == pytest.approx(6300 * 1e-9)


@pytest.fixture(scope="module")
def plan_main():
    import importlib.util

    spec = importlib.util.spec_from_file_location("_plan_layout_tool", REPO / "tools" / "plan_layout.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


@pytest.mark.parametrize("flags,fits", [  # without options: tests/test_planner.py (does not fit)
    (["--grad-reduce-dtype", "bf16"], False),
    (["--optimizer-cpu-offload"], True),
    (["--optimizer-cpu-offload", "--grad-reduce-dtype", "bf16"], True),
])
def test_seed_recipe_on_h100_with_each_option(plan_main, tmp_path, capsys, flags, fits):
    out = tmp_path / "plan.json"
    assert plan_main(["--config", str(RECIPE), "--gpu", "h100-80gb", "--json", str(out)] + flags) == 0
    plan = json.loads(out.read_text())
    assert plan["fits"] is fits and plan["host_fits"]
    worst = max(plan["per_rank"], key=lambda r: r["peak_memory_gib"])
    if "--optimizer-cpu-offload" in flags:
        assert worst["optimizer_bytes"] == 0 and worst["host_optimizer_bytes"] > 0
        assert "--optimizer-cpu-offload: 100% of each optimizer's" in capsys.readouterr().out
    if "bf16" in flags:
        assert worst["grad_bytes"] == worst["weight_bytes"]  # bf16 over the same padded buffers as the weights


def test_recipe_keys(plan_main, tmp_path):
    """The options as --config keys (what a recipe variant writes) plan like the flags."""
    recipe = tmp_path / "h100.yaml"
    recipe.write_text(RECIPE.read_text() + "optimizer-cpu-offload: true\noptimizer-offload-fraction: 0.75\n"
                      "grad-reduce-dtype: bf16\n")
    out = tmp_path / "plan.json"
    assert plan_main(["--config", str(recipe), "--gpu", "h100-80gb", "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    worst = max(plan["per_rank"], key=lambda r: r["peak_memory_gib"])
    assert plan["fits"] and worst["grad_bytes"] == worst["weight_bytes"]
    assert worst["optimizer_bytes"] > 0 and worst["host_optimizer_bytes"] > 0  # a quarter stays on the GPU
