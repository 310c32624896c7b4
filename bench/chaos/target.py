"""What a chaos run needs from a training method under test: M unit slots and what each fault does to them.

The executor (``harness.py``) calls these methods at the times of the fault schedule, and ``tick`` about every
0.2 s so a method can react to failures on its own (e.g. a gang restarting its ranks). Every method returns at once
(no method may wait for training), and every pid it returns is recorded in the executed-schedule log.
"""

from __future__ import annotations

from typing import Protocol

from bench.chaos.results import MethodResult


class ChaosTarget(Protocol):
    name: str
    started_at: float  # unix time at which every process had been launched

    def start(self) -> None:
        """Start the bootstrap (or rendezvous) node and all M units; returns once they are launched."""

    def crash(self, unit: int) -> list[int]:
        """SIGKILL every process of ``unit`` (a machine that loses power); returns the pids killed."""

    def recover(self, unit: int) -> list[int]:
        """``unit``'s machine is back: restart it as the method's recovery policy says; returns new pids."""

    def freeze(self, unit: int) -> list[int]:
        """SIGSTOP every process of ``unit`` (a straggler); returns the frozen pids."""

    def thaw(self, unit: int) -> list[int]:
        """SIGCONT what :meth:`freeze` stopped; returns the pids resumed."""

    def partition(self, unit: int) -> None:
        """Cut ``unit``'s network link (its processes keep running)."""

    def heal(self, unit: int) -> None:
        """Restore ``unit``'s network link."""

    def crash_bootstrap(self) -> list[int]:
        """SIGKILL the bootstrap (or rendezvous) node; returns the pids killed."""

    def recover_bootstrap(self) -> list[int]:
        """Restart the bootstrap (or rendezvous) node; returns its new pids."""

    def tick(self) -> None:
        """React to what the method detects by itself (called about every 0.2 s)."""

    def finish(self) -> None:
        """The wall-time budget is over: stop every unit gracefully (bounded), then every process left."""

    def result(self) -> MethodResult:
        """What the run produced, read from the units' logs once :meth:`finish` returned."""
