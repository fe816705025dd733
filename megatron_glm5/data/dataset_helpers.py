"""megatron-core's compiled dataset helpers (``megatron.core.datasets.helpers_cpp``, the C++ sample-index
builders GPTDataset and BlendedDataset need): imported, or built when the installed megatron-core lacks them."""
from __future__ import annotations

import logging
import os
import sys

__all__ = ["ensure_helpers"]

logger = logging.getLogger(__name__)


def ensure_helpers():
    """Import megatron-core's compiled dataset helpers (``megatron.core.datasets.helpers_cpp``), building them if needed.

    The megatron-core wheel ships ``helpers_cpp.*.so``.  A source checkout builds it with ``make`` (its Makefile
    compiles ``helpers.cpp`` with g++ and pybind11) via ``megatron.core.datasets.utils.compile_helpers``; the wheel
    has no Makefile, so when the .so is missing we run the same compile ourselves into a user cache directory.
    """
    import importlib

    try:
        return importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError as first_error:
        err = first_error
    import megatron.core.datasets as mds

    pkg_dir = os.path.dirname(mds.__file__)
    if os.path.isfile(os.path.join(pkg_dir, "Makefile")) and os.access(pkg_dir, os.W_OK):
        from megatron.core.datasets.utils import compile_helpers

        compile_helpers()
        return importlib.import_module("megatron.core.datasets.helpers_cpp")
    return _compile_helpers_into_cache(os.path.join(pkg_dir, "helpers.cpp"), err)


def _compile_helpers_into_cache(source: str, import_error: Exception):
    import importlib.machinery
    import importlib.util
    import shutil
    import subprocess
    import sysconfig

    if not os.path.isfile(source):
        raise ImportError(f"megatron.core.datasets.helpers_cpp is missing and so is its source {source}; "
                          f"reinstall megatron-core") from import_error
    try:
        import pybind11
    except ImportError:
        raise ImportError("megatron.core.datasets.helpers_cpp is not built and pybind11 is missing to build it: "
                          "`pip install pybind11` (and have g++), or reinstall the megatron-core wheel") from import_error
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise ImportError("megatron.core.datasets.helpers_cpp is not built and no C++ compiler (g++) was found")
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "megatron_glm5",
                         "helpers", f"{os.path.getmtime(source):.0f}")
    os.makedirs(cache, exist_ok=True)
    target = os.path.join(cache, "helpers_cpp" + suffix)
    if not os.path.isfile(target):
        tmp = f"{target}.{os.getpid()}.tmp"
        cmd = [cxx, "-O3", "-Wall", "-shared", "-std=c++11", "-fPIC", f"-I{pybind11.get_include()}",
               f"-I{sysconfig.get_paths()['include']}", source, "-o", tmp]
        logger.info("building megatron-core dataset helpers: %s", " ".join(cmd))
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise ImportError(f"building megatron.core.datasets.helpers_cpp failed:\n{res.stderr[-2000:]}")
        os.replace(tmp, target)
    spec = importlib.util.spec_from_file_location("megatron.core.datasets.helpers_cpp", target)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["megatron.core.datasets.helpers_cpp"] = module
    import megatron.core.datasets as mds

    mds.helpers_cpp = module
    return module
