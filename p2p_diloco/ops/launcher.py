"""Start and stop peers as separate OS processes: the command lines of ``p2p-diloco bootstrap`` and ``join``, each
process in a session (process group) of its own, and a clean stop of whole groups (the demo uses it, and so do the
laboratory's swarms and the tests); and the ranks of one unit under torch's elastic launcher (:func:`launch_ranks`)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

BOOTSTRAP_TIMEOUT_S = 60.0
CLI = [sys.executable, "-m", "p2p_diloco.cli"]


class ChildProcess(Protocol):
    """A started peer process: ``subprocess.Popen`` or a look-alike (the laboratory's preloaded nodes)."""

    pid: int

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def join_command(initial_peers: Sequence[str], work_dir: Path, duration_s: float, run_id: str,
                 cli: Sequence[str] = CLI) -> list[str]:  # fmt: skip
    """``p2p-diloco join`` of one unit of the tiny preset for ``duration_s`` seconds, its console quiet, its consensus
    model exported to ``work_dir``/model (later flags appended to it override these); ``cli`` is the program that
    takes the subcommand (the package's CLI, or a modified copy of it)."""
    return [
        *cli, "join",
        "--preset", "tiny",
        "--run-id", run_id,
        "--initial-peers", *initial_peers,
        "--max-time-s", str(duration_s),
        "--work-dir", str(work_dir),
        "--save-dir", str(work_dir / "model"),
        "--no-progress",
    ]  # fmt: skip


def bootstrap_command(
    work_dir: Path, initial_peers: tuple[str, ...] = (), host: str = "127.0.0.1", port: int = 0
) -> list[str]:
    """The ``p2p-diloco bootstrap`` command line listening on ``host``:``port`` (0: any free port). Its identity is
    kept in ``work_dir``, so a restart on the same port serves the same multiaddr."""
    command = [*CLI, "bootstrap", "--identity-path", str(work_dir / "bootstrap.key"), "--host-maddrs",
               f"/ip4/{host}/tcp/{port}"]  # fmt: skip
    return command + (["--initial-peers", *initial_peers] if initial_peers else [])


def start_bootstrap(
    work_dir: Path,
    initial_peers: tuple[str, ...] = (),
    host: str = "127.0.0.1",
    port: int = 0,
    wrap: Callable[[list[str]], list[str]] | None = None,
) -> tuple[subprocess.Popen, str]:
    """Start :func:`bootstrap_command` and return it with the first multiaddr it prints. ``wrap`` turns the command
    into one that runs elsewhere (e.g. in a network namespace). Raises RuntimeError (the node stopped) when it prints
    none within BOOTSTRAP_TIMEOUT_S."""
    work_dir.mkdir(parents=True, exist_ok=True)
    command = bootstrap_command(work_dir, initial_peers, host, port)
    process = spawn(wrap(command) if wrap else command, work_dir / "bootstrap.log", stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + BOOTSTRAP_TIMEOUT_S
    assert process.stdout is not None
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        if maddr := multiaddr_on(host, line.split()):
            return process, maddr
    stop_process_groups([process])
    raise RuntimeError(f"the bootstrap node printed no multiaddr; see {work_dir / 'bootstrap.log'}")


def multiaddr_on(host: str, words: Iterable[str]) -> str | None:
    """The first of ``words`` that is a peer's multiaddr on IPv4 ``host`` (None: none)."""
    return next((word for word in words if word.startswith(f"/ip4/{host}/") and "/p2p/" in word), None)


def spawn(command: list[str], log_path: Path, **popen_kwargs: Any) -> subprocess.Popen:
    """Start ``command`` in a new session (its own process group) with stderr, and stdout unless redirected
    by ``popen_kwargs``, appended to ``log_path``."""
    with open(log_path, "a") as log:
        popen_kwargs.setdefault("stdout", log)
        stderr = subprocess.STDOUT if popen_kwargs["stdout"] is log else log
        return subprocess.Popen(command, stderr=stderr, start_new_session=True, **popen_kwargs)


def stop_process_groups(processes: Sequence[ChildProcess], grace_s: float = 20.0) -> list[int]:
    """SIGTERM every process's group at once, wait up to ``grace_s`` in all, then SIGKILL the groups still
    there; returns the exit codes in order."""
    for process in processes:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    return [process.wait() for process in processes]


def launch_ranks(nproc_per_node: int, max_restarts: int, device_choice: str, argv: Sequence[str]) -> int:
    """Run ``p2p-diloco`` with ``argv`` (a ``join``) as ``nproc_per_node`` ranks under torch's elastic launcher on this
    host, restarting every rank up to ``max_restarts`` times after one failed; returns 0 once all ranks exited 0.
    Raises ConfigError for more CUDA ranks than devices, RanksLost when the unit failed after its last restart."""
    import torch  # the ranks' imports, in the launcher's process alone
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from p2p_diloco.config import ConfigError
    from p2p_diloco.unit.ranks import RanksLost

    devices = torch.cuda.device_count() if device_choice != "cpu" and torch.cuda.is_available() else 0
    if devices and nproc_per_node > devices:
        raise ConfigError(f"--nproc-per-node {nproc_per_node} but this host has {devices} CUDA devices")
    arguments = ["--standalone", f"--nproc-per-node={nproc_per_node}", f"--max-restarts={max_restarts}",
                 "-m", "p2p_diloco.cli", *argv]  # fmt: skip
    try:
        run(get_args_parser().parse_args(arguments))
    except ChildFailedError as error:
        rank, failure = error.get_first_failure()
        raise RanksLost(f"the unit failed {max_restarts + 1} times; the last time rank {rank} exited first, with "
                        f"status {failure.exitcode} (its log above says why)") from None  # fmt: skip
    return 0
