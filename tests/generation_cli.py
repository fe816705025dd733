"""tools/generate.py's command line run in process, for the tests of its errors (test_generation*.py)."""
from __future__ import annotations

import os

import pytest


def one_line_error(capsys, argv, env=None) -> str:
    """The one ``error: ...`` line tools/generate.py prints (exit status 2) for ``argv``, with ``env`` set."""
    from megatron_glm5.arguments import main_guard
    from megatron_glm5.generation import cli

    capsys.readouterr()
    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        with pytest.raises(SystemExit) as e:
            with main_guard():
                cli.main([str(a) for a in argv])
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert e.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]
