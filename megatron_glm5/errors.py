"""Errors that are the user's to fix (a bad flag, a missing file, a malformed sample).

The entry scripts print these as one line, ``error: <message>``, and exit with status 2, without a traceback
(see :func:`megatron_glm5.arguments.main_guard`).  Anything else is a bug and keeps its traceback.

Subclass :class:`UserError` for such errors in any module; multiple inheritance with ``ValueError`` (or another
builtin) keeps ``except ValueError`` callers working::

    class DataError(UserError, ValueError): ...

This module has no dependencies, so every module may import it.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["FlagError", "UserError"]


class UserError(Exception):
    """An error the user can fix; its message says what is wrong and what to do instead."""


class FlagError(UserError, ValueError):
    """A bad flag value or flag combination; ``flag`` names the (first) offending flag when there is one, by default
    the subclass's ``FLAG`` (the flag module's own)."""

    FLAG: Optional[str] = None

    def __init__(self, message: str, flag: Optional[str] = None):
        super().__init__(message)
        self.flag = flag if flag is not None else self.FLAG
