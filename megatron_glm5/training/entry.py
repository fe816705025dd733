"""Shared body of the entry scripts: parse and validate flags, set up logging, train; user errors are one line."""
from __future__ import annotations

import logging
import os
import sys


def _setup_logging():
    rank = os.environ.get("RANK", "0")
    fmt = "%(asctime)s %(levelname)s %(message)s" if rank == "0" else f"%(asctime)s [rank {rank}] %(levelname)s %(message)s"
    logging.basicConfig(level=logging.INFO, format=fmt, datefmt="%H:%M:%S", stream=sys.stdout)
    for noisy in ("megatron.core", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # dist_checkpointing warns about its own deprecated default on every save
    logging.getLogger("megatron.core.dist_checkpointing").setLevel(logging.ERROR)


def main(mode: str, argv=None) -> int:
    from megatron_glm5.arguments import main_guard, parse_args, validate_args

    _setup_logging()
    with main_guard():
        args = parse_args(argv, mode=mode)
        validate_args(args)
        from megatron_glm5.training.data import check_data_paths
        check_data_paths(args)
        from megatron_glm5.planning.check import check_fits
        check_fits(args)  # one line and the plan_layout command when this rank cannot hold its share
        import warnings
        warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core")
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        from megatron_glm5.training.loop import train
        return train(args)
