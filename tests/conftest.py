import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))  # test helpers (hf_tiny.py)

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def layouts_reference(tmp_path_factory):
    """The single-process reference of the CPU layout tests (tests/layouts_harness.py), built once per session
    for every test file that compares a layout with it."""
    from layouts_harness import make_layouts_reference

    return make_layouts_reference(tmp_path_factory.mktemp("layouts"))
