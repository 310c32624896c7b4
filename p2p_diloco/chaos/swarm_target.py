"""Our decoupled swarm as a chaos target: a bootstrap node and M ``p2p-diloco join`` units as real processes.

No coordinator: a crashed unit is simply absent until its machine is back (:meth:`recover`), when it is started again
on the same work dir and rejoins through the bootstrap node *and* every live unit's address, so it joins even while
the bootstrap node is down. A unit that exits with an error by itself (e.g. it could not join while partitioned) is
restarted after ``restart_delay_s``, as the shipped systemd unit does (``Restart=on-failure``).
"""

from __future__ import annotations

import logging
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from p2p_diloco.chaos.faults import freeze_tree, kill_tree, thaw
from p2p_diloco.chaos.network import ChaosNetwork
from p2p_diloco.chaos.results import EvalPoint, MethodResult, UnitResult
from p2p_diloco.demo import (
    CORPUS,
    TINY_MODEL,
    bootstrap_command,
    peer_command,
    spawn,
    start_bootstrap,
    stop_process_groups,
)
from p2p_diloco.goodput import LEDGER_FILE, GoodputLedger
from p2p_diloco.metrics import MetricsLog, read_events

logger = logging.getLogger(__name__)

BOOTSTRAP_PORT = 45_123


@dataclass(frozen=True)
class TrainingSetup:
    """What every method of a comparison trains, identically: model, data, batch, optimizers, eval cadence."""

    model_config: Path
    dataset: Path
    seq_len: int = 64
    batch_size: int = 8
    inner_lr: float = 3e-3
    inner_steps: int = 20
    eval_every_steps: int = 100
    eval_batches: int = 8
    seed: int = 0

    @classmethod
    def shipped(cls, inner_steps: int, eval_every_steps: int, seed: int) -> TrainingSetup:
        """The shipped tiny model and corpus, with the given cadences and seed (other fields at their defaults)."""
        return cls(TINY_MODEL, CORPUS, inner_steps=inner_steps, eval_every_steps=eval_every_steps, seed=seed)

    def join_flags(self) -> list[str]:
        return [
            "--model-config", str(self.model_config),
            "--dataset", str(self.dataset),
            "--seq-len", str(self.seq_len),
            "--batch-size", str(self.batch_size),
            "--inner-lr", str(self.inner_lr),
            "--inner-steps", str(self.inner_steps),
            "--eval-every-rounds", str(max(1, self.eval_every_steps // self.inner_steps)),
            "--eval-batches", str(self.eval_batches),
            "--seed", str(self.seed),
        ]  # fmt: skip


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
        self.setup, self.budget_s, self.extra_flags, self.log = setup, budget_s, extra_flags, log
        self.processes: dict[int, subprocess.Popen] = {}
        self.frozen: dict[int, list[int]] = {}
        self.bootstrap: subprocess.Popen | None = None
        self.bootstrap_maddr = ""
        self.started_at = 0.0
        self.restart_delay_s = restart_delay_s
        self.crashed: set[int] = set()
        self.restart_at: dict[int, float] = {}

    # ---------------------------------------------------------------------------------------------- nodes
    def _unit_dir(self, unit: int) -> Path:
        return self.run_dir / f"unit{unit}"

    def _bootstrap_dir(self) -> Path:
        return self.run_dir / "bootstrap"

    def _live_maddrs(self) -> list[str]:
        """Addresses of the units running now, from their latest ``join`` event."""
        maddrs = []
        for unit, process in self.processes.items():
            if process.poll() is None and unit not in self.frozen:
                joins = [
                    event for event in read_events(self._unit_dir(unit) / "metrics.jsonl") if event["event"] == "join"
                ]
                if joins and joins[-1].get("multiaddrs"):
                    maddrs += joins[-1]["multiaddrs"].split()
        return maddrs

    def _start_unit(self, unit: int) -> list[int]:
        work_dir = self._unit_dir(unit)
        work_dir.mkdir(parents=True, exist_ok=True)
        host = self.network.host(f"unit{unit}")
        initial_peers = [self.bootstrap_maddr, *self._live_maddrs()]
        command = peer_command(initial_peers[0], work_dir, duration_s=self.budget_s * 10, run_id=self.name)
        command += [
            "--initial-peers", *initial_peers,
            "--host-maddrs", f"/ip4/{host}/tcp/0",
            *self.setup.join_flags(),
            *self.extra_flags,
        ]  # fmt: skip
        process = spawn(self.network.wrap(f"unit{unit}", command), work_dir / "stdout.log")
        self.processes[unit] = process
        return [process.pid]

    # ------------------------------------------------------------------------------------ ChaosTarget
    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.bootstrap, self.bootstrap_maddr = start_bootstrap(
            self._bootstrap_dir(),
            host=self.network.host("bootstrap"),
            port=BOOTSTRAP_PORT,
            wrap=lambda command: self.network.wrap("bootstrap", command),
        )
        for unit in range(self.units):
            self._start_unit(unit)
        self.started_at = time.time()

    def crash(self, unit: int) -> list[int]:
        self.frozen.pop(unit, None)
        self.crashed.add(unit)
        self.restart_at.pop(unit, None)
        process = self.processes.get(unit)
        return kill_tree(process.pid) if process is not None and process.poll() is None else []

    def recover(self, unit: int) -> list[int]:
        self.crashed.discard(unit)
        return self._start_unit(unit)

    def freeze(self, unit: int) -> list[int]:
        process = self.processes.get(unit)
        if process is None or process.poll() is not None:
            return []
        self.frozen[unit] = freeze_tree(process.pid)
        return self.frozen[unit]

    def thaw(self, unit: int) -> list[int]:
        return thaw(self.frozen.pop(unit, []))

    def partition(self, unit: int) -> None:
        self.network.cut(f"unit{unit}")

    def heal(self, unit: int) -> None:
        self.network.restore(f"unit{unit}")

    def crash_bootstrap(self) -> list[int]:
        return kill_tree(self.bootstrap.pid) if self.bootstrap is not None and self.bootstrap.poll() is None else []

    def recover_bootstrap(self) -> list[int]:
        """Restart it on the same port and identity (same multiaddr) without waiting for it to be ready."""
        command = bootstrap_command(self._bootstrap_dir(), host=self.network.host("bootstrap"), port=BOOTSTRAP_PORT)
        self.bootstrap = spawn(self.network.wrap("bootstrap", command), self._bootstrap_dir() / "bootstrap.log")
        return [self.bootstrap.pid]

    def tick(self) -> None:
        now = time.monotonic()
        for unit, process in self.processes.items():
            code = process.poll()
            if code in (None, 0) or unit in self.crashed or unit in self.restart_at:
                continue
            self.restart_at[unit] = now + self.restart_delay_s
            logger.warning("unit exited by itself method=%s unit=%d code=%s", self.name, unit, code)
            if self.log is not None:
                self.log.write("unit_exit", method=self.name, unit=unit, exit_code=code)
        for unit, when in list(self.restart_at.items()):
            if now >= when:
                del self.restart_at[unit]
                pids = self._start_unit(unit)
                if self.log is not None:
                    self.log.write("unit_restart", method=self.name, unit=unit, pids=" ".join(map(str, pids)))

    def finish(self) -> None:
        for unit in list(self.frozen):
            self.thaw(unit)
        stop_process_groups(list(self.processes.values()), grace_s=120.0)
        if self.bootstrap is not None:
            stop_process_groups([self.bootstrap])

    def result(self) -> MethodResult:
        result = swarm_result(self.name, self.run_dir, self.units, self.budget_s, self.started_at)
        if self.log is not None:
            faults = [event for event in read_events(self.log.path) if event.get("method") == self.name]
            result.notes += recovery_notes(self.run_dir, faults)
            result.notes.append(time_breakdown(self.run_dir, faults, self.units, self.budget_s, self.started_at))
        return result


def time_breakdown(run_dir: Path, faults: list[dict], units: int, budget_s: float, started_at: float) -> str:
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
        joins = [event["time"] for event in read_events(unit_dir / "metrics.jsonl") if event["event"] == "join"]
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


def recovery_notes(run_dir: Path, faults: list[dict]) -> list[str]:
    """One line per recovered crash: seconds from the restart to the unit's join, and from the start of its state
    download to the end of its join eval (after which it trains); and one line per unit with the longest gap between
    two of its ``inner_step`` events outside its own faults (how long the others ever paused)."""
    notes = []
    events = {unit: read_events(run_dir / f"unit{unit}" / "metrics.jsonl") for unit in _units_in(run_dir)}
    for fault in faults:
        if fault["event"] != "fault" or fault["kind"] != "crash" or fault["phase"] != "end":
            continue
        after = [event for event in events.get(fault["unit"], []) if event["time"] >= fault["time"]]
        join = next((event for event in after if event["event"] == "join"), None)
        download = next((event for event in after if event["event"] == "state_download"), None)
        join_eval = next((event for event in after if event["event"] == "eval" and event["reason"] == "join"), None)
        if join is None or download is None or join_eval is None:
            notes.append(f"unit{fault['unit']} restarted at {fault['actual_s']:.0f} s: no join with a download")
            continue
        download_started = download["time"] - download["seconds"]
        joined_after = join["time"] - fault["time"]
        notes.append(
            f"unit{fault['unit']} restarted at {fault['actual_s']:.0f} s: joined after {joined_after:.1f} s"
            f" (process start included); state download {download['seconds']:.2f} s; download start to training"
            f" {join_eval['time'] - download_started:.2f} s"
        )
    for unit, unit_events in events.items():
        own = [
            (begin, float("inf") if ended is None else ended)
            for kind, begin, ended in _fault_windows(faults, unit)
            if kind in ("crash", "straggler")
        ]
        steps = [event["time"] for event in unit_events if event["event"] == "inner_step"]
        gaps = [
            later - earlier
            for earlier, later in zip(steps, steps[1:])
            if not any(start - 1 <= later and earlier <= end + 1 for start, end in own)
        ]
        if gaps:
            notes.append(f"unit{unit}: longest gap between 10-step marks outside its own faults {max(gaps):.1f} s")
    return notes


def _read_ledger(unit_dir: Path) -> GoodputLedger | None:
    """The unit's goodput ledger as it was left (unlike ``GoodputLedger.load_or_create``, counts no start); None if
    the unit never started."""
    path = unit_dir / LEDGER_FILE
    return GoodputLedger.model_validate_json(path.read_bytes()) if path.exists() else None


def _units_in(run_dir: Path) -> list[int]:
    return sorted(int(path.name.removeprefix("unit")) for path in run_dir.glob("unit*") if path.is_dir())


def _fault_windows(faults: list[dict], unit: int) -> list[tuple[str, float, float | None]]:
    """(kind, begin, end) unix times of the unit's own faults from the schedule log; end is None for one that never
    ended (a unit has one fault at a time, so each end closes the last begin of its kind)."""
    windows: list[tuple[str, float, float | None]] = []
    begun: dict[str, float] = {}
    for fault in faults:
        if fault["event"] == "fault" and fault["unit"] == unit:
            if fault["phase"] == "begin":
                begun[fault["kind"]] = fault["time"]
            elif fault["kind"] in begun:
                windows.append((fault["kind"], begun.pop(fault["kind"]), fault["time"]))
    return windows + [(kind, start, None) for kind, start in begun.items()]


def swarm_result(name: str, run_dir: Path, units: int, budget_s: float, started_at: float) -> MethodResult:
    """Read every unit's metrics.jsonl and goodput ledger (all restarts of a unit share its work dir).

    Useful compute and tokens are the ledger's (steps merged by a successful round). The eval curve takes every
    eval of the global parameters, paired with the swarm's merged tokens at that time (the sum over units of their
    latest cumulative ``useful_tokens``). The final loss is the median of the final evals written when the budget
    ended (a unit down at that time has none).
    """
    per_unit = [read_events(run_dir / f"unit{unit}" / "metrics.jsonl") for unit in range(units)]
    results, merged, evals, finals = [], [], [], []
    for unit, events in enumerate(per_unit):
        ledger = _read_ledger(run_dir / f"unit{unit}")
        if ledger is None:
            results.append(UnitResult(unit, 0.0, 0.0, 0, 0))
            continue
        results.append(UnitResult(unit, ledger.compute_s, ledger.useful_compute_s, ledger.tokens, ledger.useful_tokens))
        merged += [(event["time"], unit, event["useful_tokens"]) for event in events if event["event"] == "outer_round"]
        evals += [event for event in events if event["event"] == "eval"]
        finals += [
            event["eval_loss"]
            for event in events
            if event["event"] == "eval" and event["reason"] == "final" and event["time"] >= started_at + budget_s
        ]
    merged.sort()
    points = []
    for event in sorted(evals, key=lambda item: item["time"]):
        latest: dict[int, int] = {}
        for when, unit, tokens in merged:
            if when > event["time"]:
                break
            latest[unit] = tokens
        points.append(EvalPoint(event["time"] - started_at, sum(latest.values()), event["eval_loss"]))
    final = statistics.median(finals) if finals else None
    return MethodResult(name, budget_s, results, points, final)
