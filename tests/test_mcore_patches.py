"""The registry of megatron-core patches (megatron_glm5/mcore_patches/): every patch is a complete record whose
test exists, the phases apply as documented, and a megatron-core release other than the targeted one is warned
about once, naming the patches."""
from __future__ import annotations

import ast
import re
import warnings
from pathlib import Path

import pytest

from megatron_glm5.mcore_patches import registry
from megatron_glm5.mcore_patches.record import MCORE_VERSION, Patch, Phase

REPO = Path(__file__).resolve().parents[1]
NODE_ID = re.compile(r"^(tests/[\w/]+\.py)::(\w+)(\[[^\]]+\])?$")


def _test_function(path: Path, name: str):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    return None


def _parametrized(fn: ast.FunctionDef) -> bool:
    return any("parametrize" in ast.unparse(d) for d in fn.decorator_list)


@pytest.mark.parametrize("name", list(registry.PATCHES))
def test_every_patch_is_a_complete_record_with_an_existing_test(name):
    patch = registry.PATCHES[name]
    assert patch.name == name and patch.mcore_version == MCORE_VERSION
    assert patch.phase in Phase.ALL and patch.applied_by and patch.site and patch.why
    assert patch.cpu_only == (patch.phase == Phase.CPU)
    doc = patch.apply.__doc__ or ""
    assert "megatron" in doc, f"{name}: apply's docstring names the megatron-core code it changes"
    m = NODE_ID.match(patch.test)
    assert m, f"{name}: test {patch.test!r} is not a pytest node id tests/<file>.py::<function>[<param>]"
    path, function, param = REPO / m.group(1), m.group(2), m.group(3)
    assert path.is_file(), f"{name}: {m.group(1)} does not exist"
    fn = _test_function(path, function)
    assert fn is not None, f"{name}: {m.group(1)} has no test function {function}"
    if param:
        assert _parametrized(fn), f"{name}: {function} is not parametrized, yet the node id has {param}"


def test_patches_are_in_phase_order_and_every_phase_has_its_caller():
    phases = [p.phase for p in registry.PATCHES.values()]
    assert phases == sorted(phases, key=Phase.ALL.index)
    assert set(Phase.APPLIED_BY) == set(Phase.PROCESS_WIDE)
    on_use = [p for p in registry.PATCHES.values() if p.phase == Phase.ON_USE]
    assert on_use and all(p.applied_by not in Phase.APPLIED_BY.values() for p in on_use)
    with pytest.raises(ValueError, match="names the code that applies it"):
        Patch(name="x", site="s", why="w", test="t", phase=Phase.ON_USE, apply=lambda: True)
    with pytest.raises(ValueError, match="phase 'later'"):
        Patch(name="x", site="s", why="w", test="t", phase="later", apply=lambda: True)


def test_apply_and_apply_phase_refuse_the_other_kind():
    with pytest.raises(ValueError, match="apply it with apply_phase"):
        registry.apply("cuda_streams")
    with pytest.raises(ValueError, match="not a process-wide phase"):
        registry.apply_phase(Phase.ON_USE)


def test_a_disabled_on_use_patch_is_not_applied(monkeypatch):
    class Model:
        decoder = object()

    model = Model()
    monkeypatch.setenv(registry.DISABLE_ENV, "glm5_transformer_block")
    assert registry.apply("glm5_transformer_block", model) is False
    assert type(model.decoder) is object


def test_version_check_warns_once_naming_the_patches(monkeypatch):
    monkeypatch.setattr(registry, "_VERSION_CHECKED", False)
    with pytest.warns(registry.McoreVersionWarning) as caught:
        message = registry.check_version("0.20.0")
    assert len(caught) == 1 and str(caught[0].message) == message
    assert message.startswith(f"megatron-core 0.20.0 is installed; megatron-glm5's patches of megatron-core "
                              f"target {MCORE_VERSION}: ")
    assert all(name in message for name in registry.PATCHES)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert registry.check_version("0.20.0") is None  # once per process


@pytest.mark.parametrize("installed", [MCORE_VERSION, None], ids=["targeted", "not-installed"])
def test_version_check_is_silent_for_the_targeted_release(monkeypatch, installed):
    monkeypatch.setattr(registry, "_VERSION_CHECKED", False)
    monkeypatch.setattr(registry, "installed_mcore_version", lambda: installed)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert registry.check_version() is None


def test_installed_version_drops_the_local_part(monkeypatch):
    monkeypatch.setattr(registry.importlib.metadata, "version", lambda name: "0.19.2+abc123")
    assert registry.installed_mcore_version() == "0.19.2"
