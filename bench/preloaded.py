"""Node processes that skip most of the ~5 CPU-seconds of imports a unit pays at start (torch, transformers,
datasets): each is forked from one fork server (multiprocessing's ``forkserver``) that imported those modules once.

A node started here is still a process of its own in a session of its own, running the same program as
``python -m MODULE ARGS`` or ``python SCRIPT ARGS`` would (its ``__main__`` with that ``sys.argv``, this process's
environment and working directory, stdout and stderr appended to its log). What differs from ``subprocess.Popen``:
the node is a child of the fork server, not of this process (its exit status comes through the server), and its
interpreter is not new (modules it imports are the server's, already imported; the ``random`` module and numpy's
global generator are re-seeded from the OS). The tests' swarms on 127.0.0.1 use it: on a 2-core machine every
start of three units at once otherwise costs ~8 s of wall time before any of them trains. Benchmarks start nodes
with ``subprocess`` (their timings include the start-up a user pays).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import random
import runpy
import subprocess
import sys
import traceback
from collections.abc import Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path

PRELOADED_MODULES = ["torch", "transformers.models.gpt2.modeling_gpt2", "datasets"]
"""The bulk of what a unit of the tiny preset imports (~4 of its ~5 CPU-seconds), imported once by the fork server.
Not hivemind, nor the modules of this project that import it: hivemind makes process-shared locks at import
(``MPFuture``'s), which every node forked from the server would then share, and a node SIGKILLed while holding one
hung every later node at its start (seen in a whole suite). Nor the programs that nodes run as ``__main__``: those
run afresh, as in a new interpreter (tests/test_preloaded.py checks that these modules make no such lock)."""

_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(PRELOADED_MODULES)


class PreloadedProcess:
    """A node started by :func:`start`, with the part of ``subprocess.Popen``'s interface that the swarms use
    (``pid``, ``returncode``, ``poll``, ``wait``)."""

    def __init__(self, command: Sequence[str], process: BaseProcess):
        self.args = list(command)
        self._process = process
        assert process.pid is not None
        self.pid: int = process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """The exit status (minus the signal that killed it); subprocess.TimeoutExpired if it still runs after
        ``timeout`` seconds."""
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self._process.exitcode


def can_start(command: Sequence[str]) -> bool:
    """Whether :func:`start` runs ``command``: this Python running a module (``-m``) or a script file."""
    return len(command) >= 2 and command[0] == sys.executable and (command[1] == "-m" or command[1].endswith(".py"))


def start(command: Sequence[str], log_path: Path) -> PreloadedProcess:
    """Start ``command`` (see :func:`can_start`; ValueError otherwise) from the fork server in a new session, its
    stdout and stderr appended to ``log_path``."""
    if not can_start(command):
        raise ValueError(f"not a command of this Python running a module or a script: {command}")
    log_path.touch()  # there on return, as with subprocess
    process = _context.Process(
        target=_run_as_main, args=(list(command[1:]), dict(os.environ), os.getcwd(), str(log_path)), daemon=False
    )
    process.start()
    return PreloadedProcess(command, process)


def _run_as_main(arguments: list[str], environment: dict[str, str], cwd: str, log_path: str) -> None:
    """In the forked node: its own session, log, environment and directory, then the program as ``__main__``; exits
    with the program's status (atexit handlers run, as at an interpreter's end)."""
    os.setsid()
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.clear()
    os.environ.update(environment)
    os.chdir(cwd)
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    status = 0
    try:
        if arguments[0] == "-m":
            sys.argv = [arguments[1], *arguments[2:]]
            runpy.run_module(arguments[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = arguments
            runpy.run_path(arguments[0], run_name="__main__")
    except SystemExit as exit_:
        status = _exit_status(exit_.code)
    except BaseException:  # what the interpreter does with an uncaught exception
        traceback.print_exc()
        status = 1
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(status)


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1
