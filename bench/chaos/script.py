"""What the benchmark entry points (scripts/chaos.py, scripts/wan.py) share once their arguments are parsed."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from p2p_diloco.unit.metrics import configure_logging

Config = TypeVar("Config")


def run_benchmark(
    args: argparse.Namespace,
    build: Callable[[argparse.Namespace], Config],
    run: Callable[[Config, list[str], bool], int],
    run_errors: tuple[type[Exception], ...],
) -> int:
    """Log at INFO, ``build`` the config (a ValueError is bad input) and ``run`` it with the command line to reproduce
    it (without ``--report-only``) and ``args.report_only``. Bad input, or one of ``run_errors`` from the run, prints
    one ``error: ...`` line to stderr and gives exit status 2; otherwise the run's status."""
    configure_logging("INFO")
    command = [Path(sys.executable).name, *(arg for arg in sys.argv if arg != "--report-only")]
    try:
        config = build(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        return run(config, command, args.report_only)
    except run_errors as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
