"""Process ownership of a peer: children process group, orphan reaper, ranks tied to their launcher, stop signals,
fork start method.

hivemind runs the DHT and the averager in forked processes, each of which spawns a ``p2pd`` daemon. If the main
process is SIGKILLed they keep serving the swarm as orphans. A peer therefore starts a watchdog
(:func:`start_orphan_reaper`) that leads a separate process group holding all of the peer's children, and
SIGKILLs that group once the main process is gone, whatever the cause. Run as
``python -m p2p_diloco.lifecycle PID START_TIME POLL_S`` it is that watchdog.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import NoReturn

logger = logging.getLogger(__name__)

REAPER_POLL_S = 0.1
PR_SET_PDEATHSIG = 1  # linux/prctl.h
SOCKET_SCAN_EVERY = 20
_HIVEMIND_SOCKET_PREFIX = "/tmp/hivemind-"
_P2PD_SOCKET_RE = re.compile(r"-listen=/unix(/tmp/hivemind-p2pd-([A-Za-z0-9_-]+)\.sock)")
_stop_event = threading.Event()
_children_pgid: int | None = None
_signals_installed = False


def launched() -> bool:
    """True in a process that torch's elastic launcher started (it is one rank of a unit)."""
    return "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def die_with_launcher() -> None:
    """Make the kernel SIGKILL this process (a rank) as soon as its parent, torch's elastic launcher, is gone
    (``PR_SET_PDEATHSIG``): a SIGKILLed launcher, the top process of a unit of several ranks, then takes its ranks
    with it, as a unit's main process takes its hivemind children (rank 0's watchdog then removes those). A rank
    whose launcher is already gone kills itself. Call it first thing in a rank. Off Linux nothing happens, and the
    ranks of a SIGKILLed launcher train on as orphans until a collective between them fails."""
    libc_name = ctypes.util.find_library("c")
    if not sys.platform.startswith("linux") or libc_name is None:
        return
    parent = os.getppid()
    libc = ctypes.CDLL(libc_name, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        logger.warning("could not tie this rank to its launcher: %s", os.strerror(ctypes.get_errno()))
        return
    if parent == 1 or os.getppid() != parent:  # the launcher died before the tie was made
        os.kill(os.getpid(), signal.SIGKILL)


def ensure_fork_start_method() -> None:
    """Make ``fork`` the multiprocessing start method (hivemind's DHT and averager work with nothing else)."""
    if mp.get_start_method(allow_none=True) != "fork":
        mp.set_start_method("fork", force=True)


def _read_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state, ppid, pgrp, ...); None if the process is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return raw.rsplit(")", 1)[1].split()


def _all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def is_running(pid: int, start_time: str | None = None) -> bool:
    """True while PID exists and is not a zombie (and, if given, still has this /proc start time)."""
    fields = _read_stat(pid)
    return fields is not None and fields[0] != "Z" and (start_time is None or fields[19] == start_time)


def group_pids(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is PGID."""
    pids = []
    for pid in _all_pids():
        fields = _read_stat(pid)
        if fields is not None and fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(pid)
    return pids


def descendant_pids(pid: int) -> list[int]:
    """Live descendants of PID (children first-level first), read from /proc."""
    children: dict[int, list[int]] = {}
    for other in _all_pids():
        fields = _read_stat(other)
        if fields is not None and fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(other)
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for parent in frontier for child in children.get(parent, [])]
        found.extend(frontier)
    return found


def kill_process_tree(pid: int) -> None:
    """SIGKILL PID and all its live descendants; processes that are already gone are ignored."""
    for target in [pid, *descendant_pids(pid)]:
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start_orphan_reaper(poll_s: float = REAPER_POLL_S) -> subprocess.Popen:
    """Start the watchdog as the leader of a new *children group* and move every process forked from now on
    (hivemind's DHT and averager processes, and the p2pd daemons they spawn) into that group.

    Signals sent to this process's own group (Ctrl+C in a terminal, a supervisor's SIGTERM to the job) then
    reach this process only, which shuts its children down in order: a child killed by such a signal could die
    holding hivemind's cross-process future lock and hang this process forever. When this process is gone for
    any reason (exit, crash, SIGKILL), the watchdog removes the hivemind socket files of this process and of the
    children group and SIGKILLs that group, itself included. Call it once, before starting hivemind.
    """
    global _children_pgid
    if _children_pgid is not None:
        raise RuntimeError("start_orphan_reaper was already called in this process")
    pid = os.getpid()
    fields = _read_stat(pid)
    assert fields is not None
    reaper = subprocess.Popen(
        [sys.executable, "-m", "p2p_diloco.lifecycle", str(pid), fields[19], str(poll_s)],
        stdin=subprocess.DEVNULL,
        process_group=0,
        close_fds=True,
    )
    _children_pgid = reaper.pid
    os.register_at_fork(after_in_child=_join_children_group)
    return reaper


def ensure_orphan_reaper() -> None:
    """:func:`start_orphan_reaper` unless this process already runs one (a library caller may enter several units)."""
    if _children_pgid is None:
        start_orphan_reaper()


def children_group() -> int | None:
    """The process group of this process's forked children (the watchdog's pid), once the watchdog runs."""
    return _children_pgid


def _join_children_group() -> None:
    if _children_pgid is not None and os.getpgid(0) != _children_pgid:
        try:
            os.setpgid(0, _children_pgid)
        except OSError as error:  # the watchdog is gone: this process is being torn down anyway
            logger.debug("could not join the children group pgid=%d error=%s", _children_pgid, error)


def hivemind_sockets(pids: Iterable[int]) -> list[Path]:
    """hivemind's unix socket files of ``pids``: each p2pd daemon's and its first client's (named on the daemon's
    command line), and every other ``/tmp/hivemind-*`` socket these processes have open (each forked hivemind
    process replicates the client under a name of its own). Files may be gone already."""
    sockets = []
    inodes: set[str] = set()
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            inodes |= _socket_inodes(pid)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        for path, uid in _P2PD_SOCKET_RE.findall(cmdline):
            sockets += [Path(path), Path(f"/tmp/hivemind-p2pclient-{uid}.sock")]
    return sockets + _bound_unix_sockets(inodes, prefix=_HIVEMIND_SOCKET_PREFIX)


def _socket_inodes(pid: int) -> set[str]:
    """Inodes of the sockets ``pid`` has open (``socket:[N]`` links in /proc/PID/fd)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # an fd closed while we read
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    return inodes


def _bound_unix_sockets(inodes: set[str], prefix: str) -> list[Path]:
    """Paths under ``prefix`` of the unix sockets with these inodes (/proc/net/unix: ... Inode Path)."""
    paths = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) >= 8 and fields[6] in inodes and fields[7].startswith(prefix):
                paths.append(Path(fields[7]))
    return paths


def _reap(pid: int, start_time: str, poll_s: float) -> None:
    """Watchdog body: wait until PID is gone, then remove the hivemind sockets of PID and of the children group (this
    process's own group), seen while they lived, and SIGKILL that group."""
    pgid = os.getpgid(0)
    sockets: list[Path] = []
    polls = 0
    while is_running(pid, start_time):
        if polls % SOCKET_SCAN_EVERY == 0:  # a full /proc scan is ~100x dearer than one stat read
            sockets = sorted(set(sockets) | set(hivemind_sockets([pid, *group_pids(pgid)])))
        polls += 1
        time.sleep(poll_s)
    sockets = sorted(set(sockets) | set(hivemind_sockets(group_pids(pgid))))
    for path in sockets:
        path.unlink(missing_ok=True)
    os.killpg(pgid, signal.SIGKILL)


def install_stop_signals() -> threading.Event:
    """Route SIGINT and SIGTERM to a stop Event: the first one requests a graceful stop, a second SIGINT raises
    KeyboardInterrupt. Must be called from the main thread. Forked children (DHT, averager) get SIGTERM back at
    its default action and ignore SIGINT, so their owner shuts them down and ``terminate()`` still works.

    Call it again after starting a hivemind averager: ``DecentralizedAverager.run_in_background`` sets SIGINT
    to SIG_IGN in the calling process (meant for its child), which would make Ctrl+C do nothing.
    """
    global _signals_installed
    signal.signal(signal.SIGINT, _on_stop_signal)
    signal.signal(signal.SIGTERM, _on_stop_signal)
    if not _signals_installed:
        os.register_at_fork(after_in_child=_reset_child_signals)
        _signals_installed = True
    return _stop_event


def _on_stop_signal(signum: int, _frame: object) -> None:
    if signum == signal.SIGINT and _stop_event.is_set():
        raise KeyboardInterrupt
    logger.warning("stop requested signal=%s (Ctrl+C again to abort)", signal.Signals(signum).name)
    _stop_event.set()


def exit_at_once(code: int) -> NoReturn:
    """End this process with ``code`` now, skipping the interpreter's finalization: for a process whose work is done
    (its files closed, its children stopped, its logs flushed here). Measured: a unit's process took 6 s to end after
    its last line of Python (8 units leaving on 2 cores; 12 s at 16), all of it in finalization with no Python frame
    on the stack; the orphan reaper removes what is left of its children group, as after a SIGKILL."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _reset_child_signals() -> None:
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # forked from a non-main thread: signal handlers cannot be changed there
        pass


if __name__ == "__main__":
    _reap(int(sys.argv[1]), sys.argv[2], float(sys.argv[3]) if len(sys.argv) > 3 else REAPER_POLL_S)
