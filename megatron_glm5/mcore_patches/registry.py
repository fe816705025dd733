"""Every patch this project makes to megatron-core, by name, and the only way to apply them.

``PATCHES`` maps each name to its record (``record.Patch``: site, why, the test that fails without it, phase, the
megatron-core release it targets), in application order: pre-import, CPU, training, build, on-use. Process-wide
phases are applied by :func:`apply_phase` (idempotent; the phase's caller is ``Phase.APPLIED_BY``); on-use
patches by :func:`apply` at the site their record names. ``APPLIED`` lists the names applied in this process.
``$MEGATRON_GLM5_DISABLE_SHIMS=name1,name2`` skips those patches (the tests use it to show each one is needed).

At the first application the installed megatron-core is compared with the release the patches target
(:func:`check_version`): a different one gets one warning naming the patches, since each may no longer apply or
no longer be needed there; nothing is refused.

Adding a patch: write it in a module of this package (megatron.core imported only inside functions: the
pre-import phase runs before it can be), give it a ``Patch`` record in that module's ``PATCHES`` with a test
that fails without it, and add the module to ``_MODULES`` below. This module must not import megatron.core.
"""
from __future__ import annotations

import importlib.metadata
import os
import warnings
from typing import Dict, List, Optional, Tuple

from megatron_glm5.mcore_patches import (
    cpu_device,
    cpu_eager_compile,
    cpu_literals,
    cpu_moe,
    cpu_optimizer,
    cpu_rng,
    gpt_model_log,
    import_shims,
    moe_device_counts,
    moe_fused_permute,
    mtp_roll,
    optimizer_resume,
    transformer_block,
)
from megatron_glm5.mcore_patches.record import Patch, Phase

DISABLE_ENV = "MEGATRON_GLM5_DISABLE_SHIMS"

# modules in application order (within a phase: the order of this list, then of each module's PATCHES)
_MODULES = (import_shims, cpu_eager_compile, cpu_rng, cpu_device, cpu_optimizer, cpu_moe, cpu_literals,
            optimizer_resume, gpt_model_log, mtp_roll, transformer_block, moe_fused_permute, moe_device_counts)


def _collect() -> Dict[str, Patch]:
    records = [p for module in _MODULES for p in module.PATCHES]
    records.sort(key=lambda p: Phase.ALL.index(p.phase))  # stable: keeps the module order inside a phase
    patches: Dict[str, Patch] = {}
    for p in records:
        if p.name in patches:
            raise ValueError(f"two megatron-core patches are named {p.name!r}")
        patches[p.name] = p
    return patches


PATCHES: Dict[str, Patch] = _collect()
APPLIED: List[str] = []


class McoreVersionWarning(UserWarning):
    """The installed megatron-core is not the release the patches were written for."""


def names(phase: str) -> Tuple[str, ...]:
    """The names of one phase's patches, in application order."""
    return tuple(name for name, p in PATCHES.items() if p.phase == phase)


def disabled() -> frozenset:
    """Names listed in ``$MEGATRON_GLM5_DISABLE_SHIMS`` (comma separated).

    Raises ValueError for an unknown name, so that a typo cannot silently disable nothing.
    """
    raw = os.environ.get(DISABLE_ENV, "")
    listed = frozenset(n.strip() for n in raw.split(",") if n.strip())
    unknown = listed - set(PATCHES)
    if unknown:
        raise ValueError(f"{DISABLE_ENV} names unknown patch(es) {sorted(unknown)}; known: {list(PATCHES)}")
    return listed


def installed_mcore_version() -> Optional[str]:
    """The installed megatron-core's release (package metadata, without a local ``+...`` part), or None."""
    try:
        return importlib.metadata.version("megatron-core").split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        return None


_VERSION_CHECKED = False


def check_version(installed: Optional[str] = None) -> Optional[str]:
    """Warn once per process (McoreVersionWarning) when megatron-core's release differs from the one a patch
    targets; returns the warning's text, or None when they match (or megatron-core is not installed)."""
    global _VERSION_CHECKED
    if _VERSION_CHECKED:
        return None
    _VERSION_CHECKED = True
    installed = installed_mcore_version() if installed is None else installed
    if installed is None:
        return None
    off = [p for p in PATCHES.values() if p.mcore_version != installed]
    if not off:
        return None
    targets = sorted({p.mcore_version for p in off})
    message = (f"megatron-core {installed} is installed; megatron-glm5's patches of megatron-core target "
               f"{', '.join(targets)}: {', '.join(p.name for p in off)}. Each may fail or no longer be needed "
               "with this release: run the tests each names (megatron_glm5/mcore_patches/registry.py) before "
               "trusting a run")
    warnings.warn(message, McoreVersionWarning, stacklevel=3)
    return message


def apply_phase(phase: str) -> List[str]:
    """Apply every patch of a process-wide phase not applied (or disabled) yet. Returns ``APPLIED``."""
    if phase not in Phase.PROCESS_WIDE:
        raise ValueError(f"{phase!r} is not a process-wide phase {Phase.PROCESS_WIDE}")
    check_version()
    skip = disabled()
    for name in names(phase):
        if name in APPLIED or name in skip:
            continue
        if PATCHES[name].apply():
            APPLIED.append(name)
    return APPLIED


def apply(name: str, *args) -> bool:
    """Apply the on-use patch ``name`` to ``args`` (see its ``applied_by``); False when it did nothing or is
    disabled."""
    patch = PATCHES[name]
    if patch.phase != Phase.ON_USE:
        raise ValueError(f"patch {name} belongs to phase {patch.phase!r}: apply it with apply_phase")
    check_version()
    if name in disabled():
        return False
    changed = bool(patch.apply(*args))
    if changed and name not in APPLIED:
        APPLIED.append(name)
    return changed
