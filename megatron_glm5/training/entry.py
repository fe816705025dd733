"""Shared body of the entry scripts: parse and validate flags, set up logging, train; user errors are one line."""
from __future__ import annotations

import logging
import os
import sys


def _setup_logging():
    rank = os.environ.get("RANK", "0")
    fmt = "%(asctime)s %(levelname)s %(message)s" if rank == "0" else f"%(asctime)s [rank {rank}] %(levelname)s %(message)s"
    logging.basicConfig(level=logging.INFO, format=fmt, datefmt="%H:%M:%S", stream=sys.stdout)


def main(mode: str, argv=None) -> int:
    from megatron_glm5 import quiet
    from megatron_glm5.arguments import main_guard, parse_args, validate_args

    _setup_logging()
    # third-party warnings that say nothing to the user, filtered before anything imports megatron-core
    quiet.install(verbose=quiet.verbose_requested(sys.argv[1:] if argv is None else argv))
    with main_guard():
        args = parse_args(argv, mode=mode)
        quiet.install(verbose=quiet.verbose_requested() or args.verbose)  # --verbose may come from --config
        validate_args(args)
        from megatron_glm5.training.data import check_data_paths
        check_data_paths(args)
        from megatron_glm5.planning.check import check_fits
        check_fits(args)  # one line and the plan_layout command when this rank cannot hold its share
        from megatron_glm5.training.loop import train
        try:
            code = train(args)
        except KeyboardInterrupt:  # the second Ctrl-C (the first finishes the step and saves: loop._ExitSignal)
            print("error: interrupted (Ctrl-C twice): stopped at once, the unfinished step is not saved; the "
                  "checkpoints reported saved are complete", file=sys.stderr, flush=True)
            return 130
        from megatron_glm5 import platform
        platform.end_of_job()  # a finished run's ranks exit cleanly (torchrun would count an abort at exit)
        return code
