"""Real swarms for the tests and the benchmarks: bootstrap nodes and learning units as separate OS processes.

Each node is named; its work dir and logs are ``root/<name>``. Every process runs in its own session (process
group), and :meth:`Swarm.close` SIGTERMs then SIGKILLs each group, so DHT/averager children and p2pd daemons never
outlive a swarm. Nodes listen on the addresses of ``network`` (127.0.0.1, or a network namespace per node). Waits
poll a condition with a deadline.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from bench import preloaded
from bench.chaos import faults
from bench.chaos.network import ChaosNetwork, Loopback
from p2p_diloco.lifecycle import descendant_pids, is_running
from p2p_diloco.ops.launcher import (
    BOOTSTRAP_TIMEOUT_S,
    CLI,
    ChildProcess,
    bootstrap_command,
    join_command,
    multiaddr_on,
    spawn,
    start_bootstrap,
    stop_process_groups,
)
from p2p_diloco.unit.events import E, Join, OuterRound, read_events

T = TypeVar("T")

QUICK_UNIT_FLAGS = (
    "--threads", "1", "--seq-len", "64", "--batch-size", "4", "--inner-steps", "10", "--join-timeout-s", "30",
    "--allreduce-timeout-s", "10",
)  # fmt: skip
"""Quick units: the tiny preset's ~1 M parameter GPT-2, 4 x 64 tokens per step, a round every 10 steps, one torch
thread each (several units share a CI machine's two cores; with torch's default of a thread per core in every unit,
the red team's joiner test took 119 s instead of 105 s), and an all-reduce bounded at 10 s (theirs take under a
second; a member that left matchmaking alone while the others began the all-reduce made them wait the default 30 s:
once or twice in each whole suite)."""


class Swarm:
    """Named nodes under ``root``. ``unit_flags`` go to every unit's ``p2p-diloco join`` after the launcher's own
    (e.g. a test's small batches or a benchmark's training setup); the flags of one :meth:`unit` call come last.
    ``preloaded``: nodes on 127.0.0.1 start from a fork server that imported their modules once
    (bench/preloaded.py: the tests' swarms; a benchmark's timings include the start-up a user pays)."""

    def __init__(
        self,
        root: Path,
        run_id: str = "test",
        network: ChaosNetwork | None = None,
        unit_flags: Sequence[str] = (),
        preloaded: bool = False,
    ):
        self.root, self.run_id = Path(root), run_id
        self.network: ChaosNetwork = network if network is not None else Loopback()
        self.unit_flags = list(unit_flags)
        self.preloaded = preloaded and isinstance(self.network, Loopback)
        self.processes: dict[str, ChildProcess] = {}
        self.killed: set[str] = set()  # nodes whose exit is expected (a fault), not an error
        self.frozen: dict[str, list[int]] = {}
        self.faulted_pids: set[int] = set()  # every pid a fault was applied to, checked gone after close()
        self.bootstrap_maddr: str | None = None
        self.bootstrap_nodes: set[str] = set()

    # ----------------------------------------------------------------------------------------------- nodes
    def bootstrap(self, name: str, initial_peers: tuple[str, ...] = (), port: int = 0) -> str:
        """Start a bootstrap node and wait for its multiaddr (the first one started is ``bootstrap_maddr``)."""
        if self.preloaded:
            maddr = self._start_preloaded_bootstrap(name, initial_peers, port)
        else:
            self.processes[name], maddr = start_bootstrap(
                self.root / name,
                initial_peers,
                host=self.network.host(name),
                port=port,
                wrap=lambda command: self.network.wrap(name, command),
            )
        self.killed.discard(name)
        self.bootstrap_nodes.add(name)
        self.bootstrap_maddr = self.bootstrap_maddr or maddr
        return maddr

    def _start_preloaded_bootstrap(self, name: str, initial_peers: tuple[str, ...], port: int) -> str:
        """:func:`start_bootstrap` from the fork server: its multiaddr is read from its log rather than a pipe."""
        work_dir, host = self.root / name, self.network.host(name)
        work_dir.mkdir(parents=True, exist_ok=True)
        log = work_dir / "bootstrap.log"
        self.processes[name] = self._start(bootstrap_command(work_dir, initial_peers, host, port), log)

        def maddr() -> str | None:
            return multiaddr_on(host, log.read_text().split() if log.exists() else [])

        return self.wait_for(maddr, BOOTSTRAP_TIMEOUT_S, f"the multiaddr of {name}")

    def restart_bootstrap(self, name: str, port: int) -> ChildProcess:
        """Start bootstrap node ``name`` again on ``port`` with its identity (same multiaddr); does not wait for it."""
        work_dir = self.root / name
        command = bootstrap_command(work_dir, host=self.network.host(name), port=port)
        self.processes[name] = self._start(self.network.wrap(name, command), work_dir / "bootstrap.log")
        self.killed.discard(name)
        return self.processes[name]

    def unit(self, name: str, initial_peers: Sequence[str], *flags: str, duration_s: float = 600.0,
             cli: Sequence[str] = CLI) -> ChildProcess:  # fmt: skip
        """Start learning unit ``name`` (again, on the same work dir, if it ran before) joining through
        ``initial_peers``, training for ``duration_s`` seconds; ``cli`` replaces the package's CLI (e.g. by a
        modified copy: the red team's units)."""
        work_dir = self.root / name
        work_dir.mkdir(parents=True, exist_ok=True)
        command = join_command(initial_peers, work_dir, duration_s, self.run_id, cli)
        command += ["--host-maddrs", f"/ip4/{self.network.host(name)}/tcp/0", *self.unit_flags, *flags]
        self.processes[name] = self._start(self.network.wrap(name, command), work_dir / "stdout.log")
        self.killed.discard(name)
        return self.processes[name]

    def dashboard(self, name: str, initial_peers: Sequence[str], interval_s: float = 1.0,
                  timeout_s: float = 60.0) -> str:  # fmt: skip
        """Start ``p2p-diloco dashboard`` of the swarm's run on a free port and return its URL once it listens."""
        work_dir = self.root / name
        work_dir.mkdir(parents=True, exist_ok=True)
        command = [*CLI, "dashboard", "--run-id", self.run_id, "--initial-peers", *initial_peers,
                   "--host", self.network.host(name), "--port", "0", "--interval", str(interval_s)]  # fmt: skip
        self.processes[name] = self._start(self.network.wrap(name, command), work_dir / "stdout.log")
        self.killed.discard(name)
        log = work_dir / "stdout.log"

        def address() -> str | None:
            lines = [line for line in log.read_text().splitlines() if " at http://" in line] if log.exists() else []
            return lines[-1].rsplit(" at ", 1)[1] if lines else None

        return self.wait_for(address, timeout_s, f"the address of {name}")

    def _start(self, command: list[str], log_path: Path) -> ChildProcess:
        if self.preloaded and preloaded.can_start(command):
            return preloaded.start(command, log_path)
        return spawn(command, log_path)

    def running(self, name: str) -> bool:
        process = self.processes.get(name)
        return process is not None and process.poll() is None

    # ---------------------------------------------------------------------------------------------- logs
    def events(self, name: str, kind: type[E], after: float = 0.0) -> list[E]:
        """Node ``name``'s events of ``kind`` (p2p_diloco/unit/events.py) written after unix time ``after``."""
        return [event for event in read_events(self.root / name / "metrics.jsonl", kind) if event.time > after]

    def rounds(self, name: str, after: float = 0.0) -> list[OuterRound]:
        """The fragment rounds unit ``name`` merged after ``after``."""
        return self.events(name, OuterRound, after)

    def join_maddrs(self, name: str) -> list[str]:
        """The multiaddrs unit ``name`` announced in its latest ``join`` event (none before it joined)."""
        joins = self.events(name, Join)
        return joins[-1].multiaddrs.split() if joins else []

    def join_address(self, name: str, timeout_s: float = 30.0) -> str:
        """A multiaddr on this node's host through which a new unit can join the swarm via unit ``name``: from its
        ``join`` event, else from the "other peers can join through:" line of its stdout.log."""
        host = self.network.host(name)

        def find() -> str | None:
            texts = [" ".join(self.join_maddrs(name))]
            log = self.root / name / "stdout.log"
            if log.exists():
                texts += [line for line in log.read_text().splitlines() if "other peers can join through:" in line]
            return multiaddr_on(host, [word for text in reversed(texts) for word in text.split()])

        return self.wait_for(find, timeout_s, f"the multiaddr of {name}")

    def tail(self, name: str, lines: int = 25) -> str:
        for log in ("stdout.log", "bootstrap.log"):
            path = self.root / name / log
            if path.exists():
                return f"--- {name}/{log}\n" + "\n".join(path.read_text().splitlines()[-lines:])
        return f"--- {name}: no log"

    def tails(self) -> str:
        return "\n".join(self.tail(name) for name in self.processes)

    def wait_for(self, condition: Callable[[], T | None], timeout_s: float, what: str) -> T:
        """Poll ``condition`` until it is truthy and return its value. AssertionError naming ``what``, with the
        nodes' log tails, at the deadline or as soon as a node exits with an error that no fault explains."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = condition()
            if value:
                return value
            for name, process in self.processes.items():
                if process.poll() not in (None, 0) and name not in self.killed:
                    raise AssertionError(
                        f"{name} exited with {process.returncode} while waiting for {what}\n{self.tail(name)}"
                    )
            time.sleep(0.25)
        raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}\n" + self.tails())

    # -------------------------------------------------------------------------------------------- faults
    def kill_main_process(self, name: str) -> list[int]:
        """SIGKILL only the node's main process; returns the pids of its children (watchdog, DHT and averager
        processes, p2pd daemons), which must go by themselves."""
        process = self.processes[name]
        children = descendant_pids(process.pid)
        self.killed.add(name)
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        return children

    def kill_tree(self, name: str) -> list[int]:
        """SIGKILL the node's main process and all its descendants at once (a machine that loses power); returns
        the pids killed (none if it was not running)."""
        self.frozen.pop(name, None)
        self.killed.add(name)
        process = self.processes.get(name)
        if process is None or process.poll() is not None:
            return []
        pids = faults.kill_tree(process.pid)
        self.faulted_pids.update(pids)
        process.wait()
        return pids

    def kill_group(self, name: str) -> list[int]:
        """SIGKILL the process group of the node's main process (what a supervisor's ``kill -9 -PGID`` does);
        returns the pids of its whole tree at that moment: the children outside that group must then exit by
        themselves."""
        process = self.processes[name]
        pids = faults.process_tree(process.pid)
        self.killed.add(name)
        self.faulted_pids.update(pids)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return pids

    def freeze(self, name: str) -> list[int]:
        """SIGSTOP the node's whole process tree (a machine that stops responding); returns the frozen pids (none
        if it was not running)."""
        if not self.running(name):
            return []
        pids = faults.freeze_tree(self.processes[name].pid)
        self.frozen[name] = pids
        self.faulted_pids.update(pids)
        return pids

    def thaw(self, name: str) -> list[int]:
        """SIGCONT the processes frozen by :meth:`freeze`; returns those still alive."""
        return faults.thaw(self.frozen.pop(name, []))

    # ----------------------------------------------------------------------------------------------- end
    def live_pids(self) -> set[int]:
        """Every live process of the swarm: each started process and its descendants (watchdog, DHT, averagers,
        p2pd), plus the pids faults were applied to that still run."""
        pids = {pid for pid in self.faulted_pids if is_running(pid)}
        for process in self.processes.values():
            if process.poll() is None:
                pids.update(faults.process_tree(process.pid))
        return pids

    def stop(self, names: Sequence[str], grace_s: float = 15.0) -> list[int]:
        """Stop these nodes (SIGTERM, then SIGKILL after ``grace_s``); returns their exit codes in order."""
        for name in names:
            if name in self.frozen:  # a stopped process keeps a SIGTERM pending until it is continued
                self.thaw(name)
        return stop_process_groups([self.processes[name] for name in names], grace_s)

    def close(self, grace_s: float = 15.0) -> None:
        """Stop every node: the units first (their last rounds may still use the bootstrap node), then the rest."""
        self.stop([name for name in self.processes if name not in self.bootstrap_nodes], grace_s)
        self.stop([name for name in self.processes if name in self.bootstrap_nodes], grace_s)


def wait_until(condition: Callable[[], object], timeout: float, what: str) -> None:
    """Poll ``condition`` every 50 ms until it is truthy; AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)
