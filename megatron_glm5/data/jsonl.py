"""A validating JSON-lines reader: every problem is reported as ``file:line: what is wrong``.

    for line_no, record in iter_jsonl("train.jsonl", required={"text": str}):
        ...

Bad lines (longer than ``max_sample_bytes``: refused before they are decoded; bytes that are not UTF-8, malformed
JSON, a string holding a lone UTF-16 surrogate escape such as ``"\\ud800"``, a value that is not an object, a
missing or mistyped required field, or a record the ``validate`` callback rejects) raise :class:`DataError`; with
``skip_bad=True`` they are counted in a :class:`JsonlStats` (by reason, with the first few messages kept) and
skipped, and a one-line summary is logged at the end.  Blank lines are ignored.  A missing path, a directory, a file with no
records, or (with ``skip_bad``) a file whose every line is bad raise :class:`DataError` naming the file.
Skipped lines are also added to :data:`SKIPPED_SAMPLES` (per file and reason), which a training run logs at its
end (docs/bad_input.md).
"""
from __future__ import annotations

import json
import logging
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Type, Union

from megatron_glm5.errors import UserError
from megatron_glm5.sample_limits import MAX_SAMPLE_BYTES

__all__ = ["DataError", "JsonlStats", "parse_jsonl_line", "iter_jsonl", "read_jsonl", "check_jsonl_path",
           "iter_raw_lines", "too_long_error", "SkippedSamples", "SKIPPED_SAMPLES", "MAX_SAMPLE_BYTES"]

logger = logging.getLogger(__name__)

Required = Union[Sequence[str], Mapping[str, Union[Type, Tuple[Type, ...]]], None]
# validate(record) raises ValueError("what is wrong") for a record it rejects (the message gets file:line).
Validator = Optional[Callable[[Dict[str, Any]], None]]

_MAX_KEPT_ERRORS = 5


class DataError(UserError, ValueError):
    """A data file the user must fix; the message starts with ``file:line:`` (or ``file:``)."""

    def __init__(self, message: str, reason: str = "invalid"):
        super().__init__(message)
        self.reason = reason


@dataclass
class JsonlStats:
    """Counts for one pass over a jsonl file (filled in as the iterator advances)."""

    path: str = ""
    lines: int = 0        # lines read, blank ones included
    bytes: int = 0        # bytes read
    blank: int = 0
    records: int = 0      # records yielded
    skipped: int = 0      # bad lines skipped (skip_bad=True)
    reasons: Counter = field(default_factory=Counter)  # reason -> skipped count
    errors: List[str] = field(default_factory=list)    # the first few messages

    def count_bad(self, err: "DataError") -> None:
        self.skipped += 1
        self.reasons[err.reason] += 1
        if len(self.errors) < _MAX_KEPT_ERRORS:
            self.errors.append(str(err))

    def summary(self) -> str:
        s = f"{self.path}: {self.records} records from {self.lines} lines"
        if self.skipped:
            why = ", ".join(f"{k} {v}" for k, v in sorted(self.reasons.items()))
            s += f"; skipped {self.skipped} bad lines ({why}); first: {self.errors[0]}"
        return s


class SkippedSamples:
    """Samples skipped in this process, per file and reason: bad lines (``skip_bad``) and over-long samples
    dropped.  The readers add to :data:`SKIPPED_SAMPLES`; the training loop logs :meth:`log_summary` at the end of
    a run (and clears it at the start)."""

    def __init__(self):
        self.files: Dict[str, Counter] = {}
        self.first: Dict[str, str] = {}

    def add(self, path: str, reasons: Mapping[str, int], first: Optional[str] = None) -> None:
        counts = Counter({k: int(v) for k, v in reasons.items() if v})
        if not counts:
            return
        self.files.setdefault(path, Counter()).update(counts)
        if first and path not in self.first:
            self.first[path] = first

    def clear(self) -> None:
        self.files.clear()
        self.first.clear()

    def total(self) -> int:
        return sum(sum(c.values()) for c in self.files.values())

    def lines(self) -> List[str]:
        """One line per file: ``path: N skipped (reason n, ...); first: message``."""
        out = []
        for path, counts in self.files.items():
            why = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
            first = f"; first: {self.first[path]}" if path in self.first else ""
            out.append(f"{path}: {sum(counts.values())} skipped ({why}){first}")
        return out

    def log_summary(self) -> None:
        if not self.files or _global_rank() != 0:
            return
        logger.warning("skipped samples: %d in %d file(s)", self.total(), len(self.files))
        for line in self.lines():
            logger.warning("  %s", line)


def _global_rank() -> int:
    try:
        import torch.distributed as dist
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    except ImportError:
        return 0


SKIPPED_SAMPLES = SkippedSamples()


def _type_name(t) -> str:
    if isinstance(t, tuple):
        return " or ".join(_type_name(x) for x in t)
    return {str: "a string", int: "an integer", float: "a number", list: "a list", dict: "an object",
            bool: "a boolean"}.get(t, t.__name__)


def _json_type_name(v: Any) -> str:
    if v is None:
        return "null"
    return {str: "a string", bool: "a boolean", int: "an integer", float: "a number", list: "a list",
            dict: "an object"}.get(type(v), type(v).__name__)


# a JSON escape of a UTF-16 surrogate (\ud800-\udfff): json decodes a lone one into a str that is not valid Unicode
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _lone_surrogate(obj: Any, where: str = "") -> Optional[Tuple[str, int, str]]:
    """(field path, character index, the surrogate) of the first string in ``obj`` (keys included) holding a lone
    surrogate, or None."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError as e:
            return where, e.start, obj[e.start]
        return None
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        inner = f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}" if where else str(key)
        found = _lone_surrogate(key, inner) if isinstance(key, str) else None
        found = found or _lone_surrogate(value, inner)
        if found:
            return found
    return None


def too_long_error(path: str, line_no: int, size: int, max_bytes: int) -> "DataError":
    """The error of a line longer than ``max_bytes`` (refused unread)."""
    return DataError(f"{path}:{line_no}: line of {size} bytes is longer than --max-sample-bytes {max_bytes} "
                     f"({max_bytes / 2**20:.3g} MiB); split the document, or raise the limit", "too_long")


def iter_raw_lines(f, max_bytes: int = MAX_SAMPLE_BYTES) -> Iterator[Tuple[int, Union[bytes, int]]]:
    """``(line_no, raw line)`` for each line of a binary file; a line longer than ``max_bytes`` (its terminator not
    counted) comes as ``(line_no, its size in bytes)`` instead, read past in bounded chunks, never held whole."""
    line_no = 0
    while True:
        raw = f.readline(max_bytes + 1)
        if not raw:
            return
        line_no += 1
        if len(raw) <= max_bytes or raw.endswith(b"\n") and len(raw) == max_bytes + 1:
            yield line_no, raw
            continue
        size = len(raw)
        while not raw.endswith(b"\n"):
            raw = f.readline(1 << 20)
            if not raw:
                break
            size += len(raw)
        yield line_no, size - raw.endswith(b"\n")


def parse_jsonl_line(raw: Union[bytes, str], path: str, line_no: int, required: Required = None,
                     validate: Validator = None) -> Dict[str, Any]:
    """Decode one line into a dict, or raise :class:`DataError` ``path:line_no: ...`` with a ``reason``."""
    where = f"{path}:{line_no}"
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            bad = raw[e.start:e.start + 4]
            raise DataError(f"{where}: not valid UTF-8 (byte {e.start + 1} of the line: {bad!r}); re-encode the file "
                            f"as UTF-8", "invalid_utf8") from None
    else:
        text = raw
    if text.startswith("\ufeff") and line_no == 1:  # a UTF-8 byte order mark
        text = text[1:]
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        snippet = text.strip()
        snippet = snippet if len(snippet) <= 60 else snippet[:57] + "..."
        raise DataError(f"{where}: malformed JSON ({e.msg} at column {e.colno}): {snippet}", "malformed_json") from None
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object per line, got {_json_type_name(obj)}", "not_an_object")
    if _SURROGATE_ESCAPE.search(text):
        found = _lone_surrogate(obj)
        if found:
            field_path, index, char = found
            raise DataError(f"{where}: field {field_path!r} holds a lone UTF-16 surrogate {char!r} (character "
                            f"{index + 1}), which is not valid Unicode; fix the \\u escape (a surrogate needs its "
                            "pair)", "lone_surrogate")
    if required:
        items = required.items() if isinstance(required, Mapping) else ((k, None) for k in required)
        for key, typ in items:
            if key not in obj:
                have = ", ".join(sorted(obj)) or "none"
                raise DataError(f"{where}: missing required field {key!r} (fields: {have})", "missing_field")
            if typ is not None and (not isinstance(obj[key], typ) or (typ in (int, float) and isinstance(obj[key], bool))):
                raise DataError(f"{where}: field {key!r} must be {_type_name(typ)}, got {_json_type_name(obj[key])}",
                                "wrong_type")
    if validate is not None:
        try:
            validate(obj)
        except DataError as e:
            raise DataError(f"{where}: {e}", e.reason) from None
        except (ValueError, TypeError, KeyError) as e:
            raise DataError(f"{where}: {e}", "invalid") from None
    return obj


def check_jsonl_path(path: Union[str, os.PathLike]) -> str:
    """``path`` as a string if it is a readable non-empty file, else :class:`DataError` naming it."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file", "missing_file")
    if os.path.isdir(path):
        raise DataError(f"{path}: is a directory, expected a .jsonl file", "missing_file")
    if os.path.getsize(path) == 0:
        raise DataError(f"{path}: file is empty", "empty_file")
    return path


def iter_jsonl(path: Union[str, os.PathLike], required: Required = None, skip_bad: bool = False,
               stats: Optional[JsonlStats] = None, validate: Validator = None,
               max_sample_bytes: int = MAX_SAMPLE_BYTES) -> Iterator[Tuple[int, Dict[str, Any]]]:
    """Yield ``(line_no, record)`` (1-based line numbers) for each valid line of a jsonl file.

    ``required``: field names, or ``{name: type or (types,)}``.  ``validate``: called with each record; raise
    ``ValueError("what is wrong")`` to reject it.  ``skip_bad``: count and skip bad lines in ``stats`` instead of
    raising.  ``max_sample_bytes``: a longer line is a bad line (reason ``too_long``), never decoded.  Pass a
    :class:`JsonlStats` to read the counts afterwards.
    """
    path = check_jsonl_path(path)
    stats = stats if stats is not None else JsonlStats()
    stats.path = path
    with open(path, "rb") as f:
        for line_no, raw in iter_raw_lines(f, max_sample_bytes):
            stats.lines += 1
            try:
                if isinstance(raw, int):
                    stats.bytes += raw
                    raise too_long_error(path, line_no, raw, max_sample_bytes)
                stats.bytes += len(raw)
                if not raw.strip():
                    stats.blank += 1
                    continue
                obj = parse_jsonl_line(raw, path, line_no, required, validate)
            except DataError as e:
                if not skip_bad:
                    raise
                stats.count_bad(e)
                continue
            stats.records += 1
            yield line_no, obj
    if stats.records == 0:
        if stats.skipped:
            raise DataError(f"{path}: no valid records: all {stats.skipped} non-blank lines are bad "
                            f"({', '.join(f'{k} {v}' for k, v in sorted(stats.reasons.items()))}); first: "
                            f"{stats.errors[0]}", "no_records")
        raise DataError(f"{path}: file is empty (no records)", "empty_file")
    if stats.skipped:
        logger.warning("%s", stats.summary())
        SKIPPED_SAMPLES.add(path, stats.reasons, stats.errors[0])


def read_jsonl(path: Union[str, os.PathLike], required: Required = None, skip_bad: bool = False,
               validate: Validator = None, max_sample_bytes: int = MAX_SAMPLE_BYTES
               ) -> Tuple[List[Tuple[int, Dict[str, Any]]], JsonlStats]:
    """All ``(line_no, record)`` pairs of a jsonl file and the :class:`JsonlStats` (see :func:`iter_jsonl`)."""
    stats = JsonlStats()
    records = list(iter_jsonl(path, required=required, skip_bad=skip_bad, stats=stats, validate=validate,
                              max_sample_bytes=max_sample_bytes))
    return records, stats
