"""What torchrun's failure summary says about a rank that stopped with one of this package's one-line errors.

torchrun (torch.distributed.elastic) gives every worker an error file, ``$TORCHELASTIC_ERROR_FILE``; when workers
fail it prints, in its own process, a ``ChildFailedError`` traceback and a summary of the failed ranks whose
``traceback :`` field is the message of that file, or "To enable traceback see: ..." when the worker wrote none.
A worker cannot keep torchrun from printing the summary; it can make the summary say what happened: a rank that
stops with a user error (exit status 2) or a lost / stopped peer (exit status 3) writes its one line there, so the
summary's "Root Cause" is that line. Outside torchrun (no variable) nothing is written.
"""
from __future__ import annotations

import json
import os
import time

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


def write_error_file(line: str) -> None:
    """Record ``line`` (``error: ...``) as this worker's failure for torchrun; never raises."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    record = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)
    except OSError:
        pass
