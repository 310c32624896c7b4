"""Real swarms for tests: bootstrap nodes and learning units as separate OS processes on 127.0.0.1.

Every process runs in its own session (process group), and :meth:`Swarm.close` SIGTERMs then SIGKILLs each
group, so DHT/averager children and p2pd daemons never outlive a test. Waits poll a condition with a deadline.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from p2p_diloco.chaos import faults
from p2p_diloco.demo import peer_command, spawn, start_bootstrap, stop_process_groups
from p2p_diloco.lifecycle import descendant_pids, is_running
from p2p_diloco.metrics import read_events

# Small and quick on 2 cores: ~1 M parameter GPT-2, 4 x 64 tokens per step, a round every 10 steps.
TEST_PEER_FLAGS = ["--seq-len", "64", "--batch-size", "4", "--inner-steps", "10", "--join-timeout-s", "30"]


class Swarm:
    def __init__(self, root: Path, run_id: str = "test"):
        self.root, self.run_id = root, run_id
        self.processes: dict[str, subprocess.Popen] = {}
        self.killed: set[str] = set()
        self.frozen: dict[str, list[int]] = {}
        self.faulted_pids: set[int] = set()  # every pid a fault was applied to, checked gone after close()
        self.bootstrap_maddr: str | None = None

    def bootstrap(self, name: str, initial_peers: tuple[str, ...] = ()) -> str:
        process, maddr = start_bootstrap(self.root / name, initial_peers)
        self.processes[name] = process
        self.bootstrap_maddr = self.bootstrap_maddr or maddr
        return maddr

    def peer(self, name: str, initial_peer: str, *extra: str, duration_s: float = 600.0) -> subprocess.Popen:
        work_dir = self.root / name
        work_dir.mkdir(parents=True, exist_ok=True)
        command = peer_command(initial_peer, work_dir, duration_s, run_id=self.run_id) + TEST_PEER_FLAGS + list(extra)
        process = spawn(command, work_dir / "stdout.log")
        self.processes[name] = process
        self.killed.discard(name)
        return process

    def events(self, name: str, kind: str | None = None) -> list[dict]:
        events = read_events(self.root / name / "metrics.jsonl")
        return [event for event in events if kind is None or event["event"] == kind]

    def rounds(self, name: str, after: float = 0.0) -> list[dict]:
        return [event for event in self.events(name, "outer_round") if event["time"] > after]

    def wait_for(self, condition: Callable[[], object], timeout_s: float, what: str) -> object:
        """Poll ``condition`` until it is truthy; fail with ``what`` and the peers' log tails at the deadline."""
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

    def tail(self, name: str, lines: int = 25) -> str:
        for log in ("stdout.log", "bootstrap.log"):
            path = self.root / name / log
            if path.exists():
                return f"--- {name}/{log}\n" + "\n".join(path.read_text().splitlines()[-lines:])
        return f"--- {name}: no log"

    def tails(self) -> str:
        return "\n".join(self.tail(name) for name in self.processes)

    def kill_main_process(self, name: str) -> list[int]:
        """SIGKILL only the unit's main process; returns the pids of its children (watchdog, DHT and averager
        processes, p2pd daemons), which must go by themselves."""
        process = self.processes[name]
        children = descendant_pids(process.pid)
        self.killed.add(name)
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        return children

    def kill_tree(self, name: str) -> list[int]:
        """SIGKILL the main process of ``name`` and all its descendants at once (a machine that loses power);
        returns the pids killed."""
        process = self.processes[name]
        self.killed.add(name)
        pids = faults.kill_tree(process.pid)
        self.faulted_pids.update(pids)
        process.wait()
        return pids

    def kill_group(self, name: str) -> list[int]:
        """SIGKILL the process group of ``name``'s main process (what a supervisor's ``kill -9 -PGID`` does); returns
        the pids of its whole tree at that moment: the children outside that group must then exit by themselves."""
        process = self.processes[name]
        pids = faults.process_tree(process.pid)
        self.killed.add(name)
        self.faulted_pids.update(pids)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return pids

    def freeze(self, name: str) -> list[int]:
        """SIGSTOP the whole process tree of ``name`` (a machine that stops responding); returns the frozen pids."""
        pids = faults.freeze_tree(self.processes[name].pid)
        self.frozen[name] = pids
        self.faulted_pids.update(pids)
        return pids

    def thaw(self, name: str) -> list[int]:
        """SIGCONT the processes frozen by :meth:`freeze`; returns those still alive."""
        return faults.thaw(self.frozen.pop(name))

    def join_address(self, name: str, timeout_s: float = 30.0) -> str:
        """A multiaddr on 127.0.0.1 through which a new unit can join the swarm via unit ``name``: from its ``join``
        event, else from the "other peers can join through:" line of its stdout.log."""

        def find() -> str | None:
            texts = [str(event.get("multiaddrs", "")) for event in self.events(name, "join")]
            log = self.root / name / "stdout.log"
            if log.exists():
                texts += [line for line in log.read_text().splitlines() if "other peers can join through:" in line]
            words = [word for text in reversed(texts) for word in text.split()]
            return next((w for w in words if w.startswith("/ip4/127.0.0.1/") and "/p2p/" in w), None)

        return str(self.wait_for(find, timeout_s, f"the multiaddr of {name}"))

    def live_pids(self) -> set[int]:
        """Every live process of the swarm: each started process and its descendants (watchdog, DHT, averagers,
        p2pd), plus the pids faults were applied to that still run."""
        pids = {pid for pid in self.faulted_pids if is_running(pid)}
        for process in self.processes.values():
            if process.poll() is None:
                pids.update(faults.process_tree(process.pid))
        return pids

    def close(self) -> None:
        for name in list(self.frozen):  # a stopped process keeps a SIGTERM pending until it is continued
            self.thaw(name)
        stop_process_groups(list(self.processes.values()), grace_s=15.0)


def wait_until(condition: Callable[[], object], timeout: float, what: str) -> None:
    """Poll ``condition`` every 50 ms until it is truthy; AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)
