"""Fault primitives on whole process trees: a learning unit is its main process plus every descendant (watchdog,
DHT and averager processes, p2pd daemons), so a frozen or killed machine is emulated by acting on all of them."""

from __future__ import annotations

import contextlib
import os
import signal

from p2p_diloco.lifecycle import descendant_pids


def process_tree(pid: int) -> list[int]:
    """PID and its live descendants, parents first."""
    return [pid, *descendant_pids(pid)]


def signal_pids(pids: list[int], signum: signal.Signals) -> list[int]:
    """Send ``signum`` to each pid; returns the pids it reached (processes already gone are skipped)."""
    reached = []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
            reached.append(pid)
    return reached


def freeze_tree(pid: int) -> list[int]:
    """SIGSTOP PID and all its descendants (a machine that stops responding); returns the frozen pids, to be
    passed to :func:`thaw`."""
    return signal_pids(process_tree(pid), signal.SIGSTOP)


def thaw(pids: list[int]) -> list[int]:
    """SIGCONT the pids frozen by :func:`freeze_tree`; returns those still alive."""
    return signal_pids(pids, signal.SIGCONT)


def kill_tree(pid: int) -> list[int]:
    """SIGKILL PID and all its descendants at once (a machine that loses power); returns the pids killed."""
    return signal_pids(process_tree(pid), signal.SIGKILL)
