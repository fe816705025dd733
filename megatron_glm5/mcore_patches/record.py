"""What a megatron-core patch is: one named record (``Patch``) and when it is applied (``Phase``).

Every change this project makes to megatron-core's own code or objects (replaced functions, re-classed
instances, methods cloned with other globals, CPU stand-ins for CUDA calls) is a ``Patch`` listed in
``registry.py``. This module imports nothing of the project or of megatron-core.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

# The megatron-core release every patch was written against (and tested with).
MCORE_VERSION = "0.19.2"


class Phase:
    """When a patch is applied, and by whom.

    The first four are process-wide and applied all at once by ``registry.apply_phase`` (idempotent; a patch
    returns True when it changed something, False when its condition does not hold). ``ON_USE`` patches change
    one object or depend on the run's layout: the code named in ``Patch.applied_by`` calls
    ``registry.apply(name, *args)`` each time it needs them.
    """
    PRE_IMPORT = "pre-import"  # before anything imports megatron.core: megatron_glm5/__init__.py
    CPU = "cpu"  # only without CUDA, once megatron.core can be imported: platform.initialize_model_parallel
    TRAINING = "training"  # any device, at the start of training: training/loop.py
    BUILD = "build"  # any device, when a model is built: model/model.py build_model
    ON_USE = "on-use"  # per object or per layout, by the code in applied_by

    PROCESS_WIDE = (PRE_IMPORT, CPU, TRAINING, BUILD)
    ALL = PROCESS_WIDE + (ON_USE,)

    # who applies the patches of a process-wide phase (an ON_USE patch names its own caller)
    APPLIED_BY = {
        PRE_IMPORT: "megatron_glm5/__init__.py (platform.apply_pre_import_shims)",
        CPU: "platform.initialize_model_parallel (platform.apply_cpu_shims), without CUDA only",
        TRAINING: "training/loop.py at the start of training",
        BUILD: "model/model.py build_model",
    }


@dataclasses.dataclass(frozen=True)
class Patch:
    """One patch of megatron-core.

    ``name``: unique, also the name ``$MEGATRON_GLM5_DISABLE_SHIMS`` takes to skip it; ``site``: the megatron-core
    code it changes; ``why``: the failure it prevents, in one sentence (``apply.__doc__`` has the details);
    ``test``: the pytest node id of a test that fails without it; ``apply``: the patch itself; ``applied_by``:
    where it is applied (the phase's caller unless given); ``mcore_version``: the megatron-core release it was written for.
    """
    name: str
    site: str
    why: str
    test: str
    phase: str
    apply: Callable[..., bool]
    applied_by: str = ""
    mcore_version: str = MCORE_VERSION

    def __post_init__(self):
        if self.phase not in Phase.ALL:
            raise ValueError(f"patch {self.name}: phase {self.phase!r} is not one of {Phase.ALL}")
        if not self.applied_by:
            if self.phase == Phase.ON_USE:
                raise ValueError(f"patch {self.name}: an on-use patch names the code that applies it (applied_by)")
            object.__setattr__(self, "applied_by", Phase.APPLIED_BY[self.phase])

    @property
    def cpu_only(self) -> bool:
        """Applied only where torch has no CUDA."""
        return self.phase == Phase.CPU
