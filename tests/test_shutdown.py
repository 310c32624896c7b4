"""Ctrl+C in a terminal and SIGTERM to the job: the unit leaves cleanly (checkpoint, export, no leftovers)."""

from __future__ import annotations

import os
import pty
import select
import signal
import sys
import time
from pathlib import Path

import pytest

from bench.swarm import wait_until
from p2p_diloco.checkpoint import load_checkpoint
from p2p_diloco.lifecycle import descendant_pids, is_running
from p2p_diloco.presets import CORPUS, TINY_MODEL
from p2p_diloco.unit.events import Eval, InnerStep, OuterRound, Stop, read_events

pytestmark = pytest.mark.swarm


def _start_in_terminal(work_dir: Path) -> tuple[int, int]:
    """Start ``p2p-diloco join`` as the foreground job of a new pseudo-terminal; returns (pid, terminal fd)."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: becomes the session leader of the new terminal
        os.execv(
            sys.executable,
            [sys.executable, "-m", "p2p_diloco.cli", "join", "--model-config", str(TINY_MODEL),
             "--dataset", str(CORPUS), "--seq-len", "32", "--batch-size", "4", "--inner-steps", "10",
             "--work-dir", str(work_dir), "--save-dir", str(work_dir / "model"), "--threads", "1"],
        )  # fmt: skip
    return pid, fd


def _drain(fd: int) -> None:
    """Read what the unit printed so that it never blocks on a full terminal buffer."""
    while select.select([fd], [], [], 0)[0]:
        try:
            if not os.read(fd, 65536):
                return
        except OSError:
            return


def _exit_code(pid: int, fd: int, timeout_s: float) -> int | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _drain(fd)
        finished, status = os.waitpid(pid, os.WNOHANG)
        if finished:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.1)
    return None


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_unit_leaves_cleanly(tmp_path: Path, how: str) -> None:
    pid, fd = _start_in_terminal(tmp_path)
    exit_code = None
    try:
        metrics = tmp_path / "metrics.jsonl"

        def trained_a_round() -> bool:
            _drain(fd)
            return bool(read_events(metrics, OuterRound))

        wait_until(trained_a_round, 120, "the unit to complete an outer round")
        children = descendant_pids(pid)
        if how == "ctrl-c":
            os.write(fd, b"\x03")  # the terminal sends SIGINT to its foreground process group
        else:
            os.killpg(pid, signal.SIGTERM)  # a supervisor stopping the whole job
        exit_code = _exit_code(pid, fd, timeout_s=60)
        assert exit_code == 0
    finally:
        if exit_code is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)
    last = read_events(metrics, InnerStep, OuterRound, Eval, Stop)[-1]
    assert isinstance(last, Stop)
    checkpoint = load_checkpoint(tmp_path / "checkpoint.pt")
    assert checkpoint is not None and checkpoint["inner_step"] == last.inner_step
    assert (tmp_path / "model" / "model.safetensors").exists()
    wait_until(lambda: not any(is_running(child) for child in children), 15, "the unit's children to exit")
