"""Third-party output that tells a user of this package nothing, filtered once, where it starts; ``--verbose``
(or ``MEGATRON_GLM5_VERBOSE=1`` for the tools) keeps all of it.

Filtered (each a warnings filter on the message and the module that warns, so nothing else is hidden):

* megatron-core's "Transformer Engine and Apex are not installed ..." (four import sites, every process and
  every spawned worker that imports megatron-core): the torch fall-backs it announces are what this package
  uses without Transformer Engine;
* megatron-core's "full scope is deprecated" (its own default ``cuda_graph_scope``; no CUDA graphs are used);
* torch.distributed.checkpoint's "torch.distributed is disabled, unavailable or uninitialized, assuming the
  intent is to load/save in a single process" (single-process runs and the conversion tools do exactly that)
  and "The argument order of load has been changed" (megatron-core's call, at every load);
* megatron-core's "MimoModelConfig is experimental" (a model class this package does not use, warned about
  when megatron-core is imported);
* DeprecationWarnings (as before this module);
* log records below WARNING from megatron-core and torch.distributed (ERROR for dist_checkpointing, which
  warns about its own deprecated default at every save);
* in the conversion tools (``tool=True``), the model builder's one-line choices (attention backend, MoE token
  permute): a conversion builds a model only to lay out its tensors, it never runs it.
"""
from __future__ import annotations

import logging
import os
import warnings
from typing import List, Optional, Sequence

VERBOSE_ENV = "MEGATRON_GLM5_VERBOSE"

# (message regex, category, module regex) as warnings.filterwarnings takes them
_WARNINGS = (
    (r"Transformer Engine and Apex are not installed", UserWarning, r"megatron\.core"),
    (r"Apex is not installed", UserWarning, r"megatron\.core"),
    (r"full scope is deprecated", UserWarning, r"megatron\.core"),
    (r"torch\.distributed is disabled, unavailable or uninitialized", UserWarning, r"torch\.distributed\.checkpoint"),
    (r"The argument order of load has been changed", UserWarning, r"torch\.distributed\.checkpoint"),
    (r"MimoModelConfig is experimental", UserWarning, r"megatron\.core"),
    (r"", DeprecationWarning, r""),
)
_LOG_LEVELS = (("megatron.core", logging.WARNING), ("torch.distributed", logging.WARNING),
               ("megatron.core.dist_checkpointing", logging.ERROR))
_TOOL_LOG_LEVELS = (("megatron_glm5.ops", logging.WARNING), ("megatron_glm5.model", logging.WARNING))

_installed: List[tuple] = []  # the filter entries this module added to warnings.filters


def verbose_requested(argv: Optional[Sequence[str]] = None) -> bool:
    """``--verbose`` among ``argv`` (the command line before it is parsed), or ``$MEGATRON_GLM5_VERBOSE``."""
    if os.environ.get(VERBOSE_ENV, "") not in ("", "0"):
        return True
    return argv is not None and "--verbose" in argv


def install(verbose: bool = False, tool: bool = False) -> None:
    """Filter the output listed in the module doc (once: calling again changes nothing); ``verbose=True``
    removes this module's filters and log levels again, so everything shows."""
    if verbose:
        for entry in _installed:
            if entry in warnings.filters:
                warnings.filters.remove(entry)
        _installed.clear()
        warnings._filters_mutated()
        for name, _ in _LOG_LEVELS + _TOOL_LOG_LEVELS:
            logging.getLogger(name).setLevel(logging.NOTSET)
        return
    if not _installed:
        for message, category, module in reversed(_WARNINGS):  # filterwarnings prepends: keep the table's order
            warnings.filterwarnings("ignore", message=message, category=category, module=module)
            _installed.append(warnings.filters[0])
    for name, level in _LOG_LEVELS + (_TOOL_LOG_LEVELS if tool else ()):
        logging.getLogger(name).setLevel(level)


def install_for_tool() -> None:
    """The tools' call (they have no --verbose flag: ``MEGATRON_GLM5_VERBOSE=1`` shows everything)."""
    install(verbose=verbose_requested(), tool=True)
