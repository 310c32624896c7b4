"""Our decoupled swarm as a chaos target: a bootstrap node and M ``p2p-diloco join`` units as real processes.

No coordinator: a crashed unit is simply absent until its machine is back (:meth:`recover`), when it is started again
on the same work dir and rejoins through the bootstrap node *and* every live unit's address, so it joins even while
the bootstrap node is down. A unit that exits with an error by itself (e.g. it could not join while partitioned) is
restarted after ``restart_delay_s``, as the shipped systemd unit does (``Restart=on-failure``).
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path

from bench.chaos.network import ChaosNetwork
from bench.chaos.results import EvalPoint, MethodResult, UnitResult
from bench.events import FaultAction, UnitExit, UnitRestart
from bench.swarm import Swarm
from bench.training import TrainingSetup
from p2p_diloco.unit.events import Eval, InnerStep, Join, OuterRound, StateDownload, read_events
from p2p_diloco.unit.goodput import LEDGER_FILE, GoodputLedger
from p2p_diloco.unit.metrics import MetricsLog

logger = logging.getLogger(__name__)

BOOTSTRAP_PORT = 45_123
BOOTSTRAP = "bootstrap"


class SwarmTarget:
    """See the module docstring. ``extra_flags`` go to every unit's ``p2p-diloco join`` (e.g. --quorum)."""

    def __init__(
        self,
        name: str,
        units: int,
        run_dir: Path,
        network: ChaosNetwork,
        setup: TrainingSetup,
        budget_s: float,
        extra_flags: tuple[str, ...] = (),
        log: MetricsLog | None = None,
        restart_delay_s: float = 5.0,
    ):
        self.name, self.units, self.run_dir, self.network = name, units, Path(run_dir), network
        self.budget_s, self.log, self.restart_delay_s = budget_s, log, restart_delay_s
        self.swarm = Swarm(self.run_dir, run_id=name, network=network, unit_flags=[*setup.join_flags(), *extra_flags])
        self.started_at = 0.0
        self.crashed: set[int] = set()
        self.restart_at: dict[int, float] = {}

    def _start_unit(self, unit: int) -> list[int]:
        """Start ``unit`` joining through the bootstrap node and every live unit's address."""
        live = [f"unit{other}" for other in range(self.units) if other != unit]
        assert self.swarm.bootstrap_maddr is not None, "start() first"
        initial_peers = [self.swarm.bootstrap_maddr, *(
            maddr for name in live if self.swarm.running(name) and name not in self.swarm.frozen
            for maddr in self.swarm.join_maddrs(name)
        )]  # fmt: skip
        return [self.swarm.unit(f"unit{unit}", initial_peers, duration_s=self.budget_s * 10).pid]

    # ------------------------------------------------------------------------------------ ChaosTarget
    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.swarm.bootstrap(BOOTSTRAP, port=BOOTSTRAP_PORT)
        for unit in range(self.units):
            self._start_unit(unit)
        self.started_at = time.time()

    def crash(self, unit: int) -> list[int]:
        self.crashed.add(unit)
        self.restart_at.pop(unit, None)
        return self.swarm.kill_tree(f"unit{unit}")

    def recover(self, unit: int) -> list[int]:
        self.crashed.discard(unit)
        return self._start_unit(unit)

    def freeze(self, unit: int) -> list[int]:
        return self.swarm.freeze(f"unit{unit}")

    def thaw(self, unit: int) -> list[int]:
        return self.swarm.thaw(f"unit{unit}")

    def partition(self, unit: int) -> None:
        self.network.cut(f"unit{unit}")

    def heal(self, unit: int) -> None:
        self.network.restore(f"unit{unit}")

    def crash_bootstrap(self) -> list[int]:
        return self.swarm.kill_tree(BOOTSTRAP)

    def recover_bootstrap(self) -> list[int]:
        """Restart it on the same port and identity (same multiaddr) without waiting for it to be ready."""
        return [self.swarm.restart_bootstrap(BOOTSTRAP, BOOTSTRAP_PORT).pid]

    def tick(self) -> None:
        now = time.monotonic()
        for unit in range(self.units):
            process = self.swarm.processes.get(f"unit{unit}")
            code = process.poll() if process is not None else None
            if code in (None, 0) or unit in self.crashed or unit in self.restart_at:
                continue
            self.restart_at[unit] = now + self.restart_delay_s
            logger.warning("unit exited by itself method=%s unit=%d code=%s", self.name, unit, code)
            if self.log is not None:
                self.log.write(UnitExit(method=self.name, unit=unit, exit_code=code))
        for unit, when in list(self.restart_at.items()):
            if now >= when:
                del self.restart_at[unit]
                pids = self._start_unit(unit)
                if self.log is not None:
                    self.log.write(UnitRestart(method=self.name, unit=unit, pids=" ".join(map(str, pids))))

    def finish(self) -> None:
        self.swarm.close(grace_s=120.0)

    def result(self) -> MethodResult:
        result = swarm_result(self.name, self.run_dir, self.units, self.budget_s, self.started_at)
        if self.log is not None:
            faults = [event for event in read_events(self.log.path, FaultAction) if event.method == self.name]
            result.notes += recovery_notes(self.run_dir, faults)
            result.notes.append(time_breakdown(self.run_dir, faults, self.units, self.budget_s, self.started_at))
        return result


def time_breakdown(run_dir: Path, faults: list[FaultAction], units: int, budget_s: float, started_at: float) -> str:
    """Where the allocated peer-time went, summed over units, as shares of it: useful compute, start-up (launch to
    first join), crashed (down, up to the budget), rejoin (machine back to joined), frozen, lost steps (computed but
    never merged) and the rest (evals, round bookkeeping, waiting for the CPU outside inner steps)."""
    end = started_at + budget_s
    totals = dict.fromkeys(("useful", "start-up", "crashed", "rejoin", "frozen", "lost steps"), 0.0)
    for unit in range(units):
        unit_dir = run_dir / f"unit{unit}"
        ledger = _read_ledger(unit_dir)
        if ledger is None:
            continue
        joins = [event.time for event in read_events(unit_dir / "metrics.jsonl", Join)]
        totals["useful"] += ledger.useful_compute_s
        totals["lost steps"] += ledger.compute_s - ledger.useful_compute_s
        totals["start-up"] += min(joins[0], end) - started_at if joins else budget_s
        for kind, begin, ended in _fault_windows(faults, unit):
            stop = min(end if ended is None else ended, end)
            if kind == "crash":
                totals["crashed"] += stop - begin
                rejoined = [time for time in joins if time > stop]
                totals["rejoin"] += min(rejoined[0], end) - stop if ended is not None and rejoined else end - stop
            elif kind == "straggler":
                totals["frozen"] += stop - begin
    allocated = budget_s * units
    rest = allocated - sum(totals.values())
    shares = ", ".join(f"{name} {seconds / allocated:.1%}" for name, seconds in [*totals.items(), ("rest", rest)])
    return f"allocated peer-time {allocated:.0f} s: {shares}"


def recovery_notes(run_dir: Path, faults: list[FaultAction]) -> list[str]:
    """One line per recovered crash: seconds from the restart to the unit's join, and from the start of its state
    download to the end of its join eval (after which it trains); and one line per unit with the longest gap between
    two of its ``inner_step`` events outside its own faults (how long the others ever paused)."""
    notes = []
    for fault in faults:
        if fault.kind == "crash" and fault.phase == "end" and fault.unit is not None:
            notes.append(_rejoin_note(run_dir / f"unit{fault.unit}" / "metrics.jsonl", fault))
    for unit in _units_in(run_dir):
        own = [
            (begin, float("inf") if ended is None else ended)
            for kind, begin, ended in _fault_windows(faults, unit)
            if kind in ("crash", "straggler")
        ]
        steps = [event.time for event in read_events(run_dir / f"unit{unit}" / "metrics.jsonl", InnerStep)]
        gaps = [
            later - earlier
            for earlier, later in zip(steps, steps[1:])
            if not any(start - 1 <= later and earlier <= end + 1 for start, end in own)
        ]
        if gaps:
            notes.append(f"unit{unit}: longest gap between 10-step marks outside its own faults {max(gaps):.1f} s")
    return notes


def _rejoin_note(metrics: Path, restart: FaultAction) -> str:
    """How the unit restarted by ``restart`` rejoined: from its first join, state download and join eval after it."""

    after = [event for event in read_events(metrics, Join, StateDownload, Eval) if event.time >= restart.time]
    join = next((event for event in after if isinstance(event, Join)), None)
    download = next((event for event in after if isinstance(event, StateDownload)), None)
    join_eval = next((event for event in after if isinstance(event, Eval) and event.reason == "join"), None)
    if join is None or download is None or join_eval is None:
        return f"unit{restart.unit} restarted at {restart.actual_s:.0f} s: no join with a download"
    download_started = download.time - download.seconds
    return (
        f"unit{restart.unit} restarted at {restart.actual_s:.0f} s: joined after {join.time - restart.time:.1f} s"
        f" (process start included); state download {download.seconds:.2f} s; download start to training"
        f" {join_eval.time - download_started:.2f} s"
    )


def _read_ledger(unit_dir: Path) -> GoodputLedger | None:
    """The unit's goodput ledger as it was left (unlike ``GoodputLedger.load_or_create``, counts no start); None if
    the unit never started."""
    path = unit_dir / LEDGER_FILE
    return GoodputLedger.model_validate_json(path.read_bytes()) if path.exists() else None


def _units_in(run_dir: Path) -> list[int]:
    return sorted(int(path.name.removeprefix("unit")) for path in run_dir.glob("unit*") if path.is_dir())


def _fault_windows(faults: list[FaultAction], unit: int) -> list[tuple[str, float, float | None]]:
    """(kind, begin, end) unix times of the unit's own faults from the schedule log; end is None for one that never
    ended (a unit has one fault at a time, so each end closes the last begin of its kind)."""
    windows: list[tuple[str, float, float | None]] = []
    begun: dict[str, float] = {}
    for fault in faults:
        if fault.unit == unit:
            if fault.phase == "begin":
                begun[fault.kind] = fault.time
            elif fault.kind in begun:
                windows.append((fault.kind, begun.pop(fault.kind), fault.time))
    return windows + [(kind, start, None) for kind, start in begun.items()]


def swarm_result(name: str, run_dir: Path, units: int, budget_s: float, started_at: float) -> MethodResult:
    """Read every unit's metrics.jsonl and goodput ledger (all restarts of a unit share its work dir).

    Useful compute and tokens are the ledger's (steps merged by a successful round). The eval curve takes every
    eval of the global parameters, paired with the swarm's merged tokens at that time (the sum over units of their
    latest cumulative ``useful_tokens``). The final loss is the median of the final evals written when the budget
    ended (a unit down at that time has none).
    """
    results: list[UnitResult] = []
    merged: list[tuple[float, int, int]] = []
    evals: list[Eval] = []
    for unit in range(units):
        ledger = _read_ledger(run_dir / f"unit{unit}")
        if ledger is None:
            results.append(UnitResult(unit, 0.0, 0.0, 0, 0))
            continue
        results.append(UnitResult(unit, ledger.compute_s, ledger.useful_compute_s, ledger.tokens, ledger.useful_tokens))
        metrics = run_dir / f"unit{unit}" / "metrics.jsonl"
        logged = read_events(metrics, OuterRound, Eval)
        merged += [(event.time, unit, event.useful_tokens) for event in logged if isinstance(event, OuterRound)]
        evals += [event for event in logged if isinstance(event, Eval)]
    finals = [
        event.eval_loss
        for event in evals
        if event.reason == "final" and event.time >= started_at + budget_s and event.eval_loss is not None
    ]
    merged.sort()
    points = []
    for event in sorted(evals, key=lambda item: item.time):
        if event.eval_loss is None:  # a non-finite loss, logged as null
            continue
        latest: dict[int, int] = {}
        for when, unit, tokens in merged:
            if when > event.time:
                break
            latest[unit] = tokens
        points.append(EvalPoint(event.time - started_at, sum(latest.values()), event.eval_loss))
    final = statistics.median(finals) if finals else None
    return MethodResult(name, budget_s, results, points, final)
