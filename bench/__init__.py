"""The laboratory: benchmarks (chaos, WAN, overhead), their baselines, harness and reports, and the manager of
real-process swarms that the tests share. It depends one way on ``p2p_diloco`` and is not part of the wheel: run it
from a checkout (``scripts/`` are its entry points; pytest puts the checkout on ``sys.path``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]


def module_command(module: str, *args: str) -> list[str]:
    """``python -m module args`` for a module of the laboratory; start it with :func:`lab_environment`."""
    return [sys.executable, "-m", module, *args]


def lab_environment() -> dict[str, str]:
    """This process's environment with the checkout first on ``PYTHONPATH``, so that a child started from any
    working directory imports ``bench``."""
    paths = [str(CHECKOUT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
