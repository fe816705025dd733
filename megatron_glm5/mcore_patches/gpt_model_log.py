"""Patch of megatron-core's logging: GPTModel's deprecation warning, which GLM5Model (a GPTModel) would print at
every build."""
from __future__ import annotations

import logging

from megatron_glm5.mcore_patches.record import Patch, Phase

_LOGGER = "megatron.core.models.gpt.gpt_model"
_MESSAGE = "GPTModel IS DEPRECATED"


class _DropGPTModelDeprecation(logging.Filter):
    def filter(self, record):
        return _MESSAGE not in record.getMessage()


def _gpt_model_deprecation_log() -> bool:
    """megatron/core/models/gpt/gpt_model.py, GPTModel.__init__ logs "GPTModel IS DEPRECATED ... use HybridModel"
    (a WARNING on rank 0) for every model built; GLM5Model is built on GPTModel on purpose, so the message only
    tells users to migrate code they do not own. A filter on that logger drops this one message."""
    logger = logging.getLogger(_LOGGER)
    if any(isinstance(f, _DropGPTModelDeprecation) for f in logger.filters):
        return False
    logger.addFilter(_DropGPTModelDeprecation())
    return True


PATCHES = (
    Patch(
        name="gpt_model_deprecation_log",
        site="megatron/core/models/gpt/gpt_model.py GPTModel.__init__ (its logger)",
        why="every build_model would log GPTModel's deprecation warning, which GLM-5 users cannot act on",
        test="tests/test_model_structure.py::test_building_logs_no_gpt_model_deprecation",
        phase=Phase.BUILD, apply=_gpt_model_deprecation_log),
)
