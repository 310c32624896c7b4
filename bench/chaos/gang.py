"""The synchronous baselines as a chaos target: a rendezvous store and one gloo rank per unit (``baseline_worker``),
supervised the way torchrun's agent supervises a job.

A unit is *available* when it is not crashed, frozen or cut off (its agent could join a rendezvous). A job
(*incarnation*) fails when any of its ranks exits; the agent then SIGKILLs every rank of it and restarts:

* ``fixed`` (torchrun without elasticity): all M ranks from the last checkpoint, once every unit is available and
  the rendezvous store is up;
* ``elastic`` (torchrun elastic): at once with the available units (ranks renumbered 0..k-1), and again with all of
  them when an available unit is not part of the job (scale-up: the job is SIGTERMed, so it stops at an agreed step
  with a final checkpoint, and is killed if it has not exited after ``scale_up_grace_s``).

Running ranks do not need the store, so a rendezvous crash only delays restarts. Every decision is logged to
``run_dir/gang.jsonl``; the ranks log to ``run_dir/unit<i>/metrics.jsonl``. Goodput is reconstructed from those logs
by :func:`kept_step_limits` and :func:`unit_results`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from bench import lab_environment, module_command
from bench.chaos.faults import freeze_tree, kill_tree, thaw
from bench.chaos.network import ChaosNetwork
from bench.chaos.results import EvalPoint, MethodResult, UnitResult
from bench.events import (
    GangCrash,
    GangFinish,
    GangFreeze,
    GangHeal,
    GangPartition,
    GangRecover,
    GangStart,
    GangThaw,
    JobEnd,
    JobStart,
    RankCheckpoint,
    RankEval,
    RankStart,
    RankStep,
    RendezvousCrash,
    RendezvousStart,
    ScaleUp,
    UnitExit,
)
from bench.training import TrainingSetup
from p2p_diloco.ops.launcher import spawn
from p2p_diloco.unit.events import Event, read_events
from p2p_diloco.unit.metrics import MetricsLog

logger = logging.getLogger(__name__)

Mode = Literal["sync-dp", "sync-diloco"]
Policy = Literal["fixed", "elastic"]
RANK_LOG = (RankStart, RankStep, RankCheckpoint, RankEval)  # the kinds of a rank's log that goodput is rebuilt from


@dataclass
class _Job:
    """One incarnation: ``processes`` maps each member unit to its rank's process (members in rank order)."""

    incarnation: int
    processes: dict[int, subprocess.Popen]
    stop_deadline: float | None = None  # monotonic time by which a graceful stop (scale-up) must be over


class GangTarget:
    """See the module docstring. ``setup`` is what every method of the comparison trains; ``log`` (the comparison's
    schedule log) also receives every rank exit; ``gloo_timeout_s`` bounds a collective with a missing peer."""

    def __init__(
        self,
        name: str,
        mode: Mode,
        policy: Policy,
        units: int,
        run_dir: Path,
        network: ChaosNetwork,
        setup: TrainingSetup,
        budget_s: float,
        log: MetricsLog | None = None,
        checkpoint_every_steps: int = 20,
        gloo_timeout_s: float = 10.0,
        stop_grace_s: float = 60.0,
        scale_up_grace_s: float = 30.0,
    ):
        if mode not in ("sync-dp", "sync-diloco") or policy not in ("fixed", "elastic") or units < 1:
            raise ValueError(f"invalid gang: mode={mode!r} policy={policy!r} units={units}")
        self.name, self.mode, self.policy, self.units = name, mode, policy, units
        self.run_dir, self.network, self.setup, self.budget_s, self.log = Path(run_dir), network, setup, budget_s, log
        self.checkpoint_every_steps, self.gloo_timeout_s = checkpoint_every_steps, gloo_timeout_s
        self.stop_grace_s, self.scale_up_grace_s = stop_grace_s, scale_up_grace_s
        self.down: set[int] = set()
        self.cut: set[int] = set()
        self.frozen: dict[int, list[int]] = {}
        self.job: _Job | None = None
        self.incarnations = 0
        self.rendezvous: subprocess.Popen | None = None
        self.port = 0
        self.started_at = 0.0
        self.gang_log: MetricsLog | None = None

    # ------------------------------------------------------------------------------------------ processes
    def _record(self, event: Event) -> None:
        assert self.gang_log is not None, "start() first"
        self.gang_log.write(event)
        fields = " ".join(f"{key}={value}" for key, value in event.fields().items())
        logger.info("gang %s %s %s", self.name, event.event, fields)

    def _rendezvous_up(self) -> bool:
        return self.rendezvous is not None and self.rendezvous.poll() is None

    def _start_rendezvous(self) -> list[int]:
        command = module_command(
            "bench.chaos.rendezvous", "--host", self.network.host("bootstrap"), "--port", str(self.port)
        )
        self.rendezvous = spawn(
            self.network.wrap("bootstrap", command), self.run_dir / "rendezvous.log", env=lab_environment()
        )
        self._record(RendezvousStart(pid=self.rendezvous.pid, port=self.port))
        return [self.rendezvous.pid]

    def available(self) -> list[int]:
        """Units whose agent could join a rendezvous now: not crashed, frozen or cut off."""
        return [unit for unit in range(self.units) if unit not in self.down | self.cut | set(self.frozen)]

    def _rank_command(self, unit: int, rank: int, world_size: int, incarnation: int) -> list[str]:
        setup = self.setup
        return module_command(
            "bench.chaos.baseline_worker",
            "--mode", self.mode,
            "--unit", str(unit), "--rank", str(rank), "--world-size", str(world_size),
            "--incarnation", str(incarnation),
            "--store-host", self.network.host("bootstrap"), "--store-port", str(self.port),
            "--host", self.network.host(f"unit{unit}"),
            "--work-dir", str(self.run_dir),
            "--model-config", str(setup.model_config), "--dataset", str(setup.dataset),
            "--seq-len", str(setup.seq_len), "--batch-size", str(setup.batch_size),
            "--eval-batches", str(setup.eval_batches), "--inner-lr", str(setup.inner_lr),
            "--inner-steps", str(setup.inner_steps), "--checkpoint-every-steps", str(self.checkpoint_every_steps),
            "--eval-every-steps", str(setup.eval_every_steps), "--gloo-timeout-s", str(self.gloo_timeout_s),
            "--seed", str(setup.seed),
        )  # fmt: skip

    def _maybe_start_job(self) -> None:
        """Start the next incarnation if the policy allows it now (see the module docstring)."""
        members = self.available()
        if not self._rendezvous_up() or not members or (self.policy == "fixed" and len(members) < self.units):
            return
        incarnation, self.incarnations = self.incarnations, self.incarnations + 1
        processes = {}
        for rank, unit in enumerate(members):
            unit_dir = self.run_dir / f"unit{unit}"
            unit_dir.mkdir(parents=True, exist_ok=True)
            command = self._rank_command(unit, rank, len(members), incarnation)
            processes[unit] = spawn(
                self.network.wrap(f"unit{unit}", command), unit_dir / "stdout.log", env=lab_environment()
            )
        self.job = _Job(incarnation, processes)
        self._record(
            JobStart(
                incarnation=incarnation,
                world_size=len(members),
                units=" ".join(map(str, members)),
                pids=" ".join(str(process.pid) for process in processes.values()),
            )
        )

    def _end_job(self, reason: Literal["failure", "scale_up", "finish"]) -> None:
        """SIGKILL what is left of the job and reap it; logs every rank's exit code."""
        assert self.job is not None
        for process in self.job.processes.values():
            if process.poll() is None:
                kill_tree(process.pid)
        codes = {unit: process.wait() for unit, process in self.job.processes.items()}
        self._record(
            JobEnd(
                incarnation=self.job.incarnation,
                reason=reason,
                exit_codes=" ".join(f"unit{unit}:{code}" for unit, code in codes.items()),
            )
        )
        self.job = None

    def _stop_job(self, grace_s: float) -> None:
        """SIGTERM every rank of the job: they stop at an agreed step; :meth:`tick` ends the job after ``grace_s``."""
        assert self.job is not None
        for process in self.job.processes.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGTERM)
        self.job.stop_deadline = time.monotonic() + grace_s

    # -------------------------------------------------------------------------------------- ChaosTarget
    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.gang_log = MetricsLog(self.run_dir / "gang.jsonl")
        self.port = _free_port()
        self.started_at = time.time()
        self._record(GangStart(mode=self.mode, policy=self.policy, units=self.units))
        self._start_rendezvous()
        self._maybe_start_job()

    def crash(self, unit: int) -> list[int]:
        self.down.add(unit)
        self.frozen.pop(unit, None)  # a machine that lost power is no longer frozen when it comes back
        process = self.job.processes.get(unit) if self.job is not None else None
        pids = kill_tree(process.pid) if process is not None and process.poll() is None else []
        self._record(GangCrash(unit=unit, pids=" ".join(map(str, pids))))
        return pids

    def recover(self, unit: int) -> list[int]:
        """Marks ``unit`` up; the policy restarts ranks on :meth:`tick` (their pids are in gang.jsonl)."""
        self.down.discard(unit)
        self._record(GangRecover(unit=unit))
        return []

    def freeze(self, unit: int) -> list[int]:
        process = self.job.processes.get(unit) if self.job is not None else None
        self.frozen[unit] = freeze_tree(process.pid) if process is not None and process.poll() is None else []
        self._record(GangFreeze(unit=unit, pids=" ".join(map(str, self.frozen[unit]))))
        return self.frozen[unit]

    def thaw(self, unit: int) -> list[int]:
        pids = thaw(self.frozen.pop(unit, []))
        self._record(GangThaw(unit=unit, pids=" ".join(map(str, pids))))
        return pids

    def partition(self, unit: int) -> None:
        self.network.cut(f"unit{unit}")
        self.cut.add(unit)
        self._record(GangPartition(unit=unit))

    def heal(self, unit: int) -> None:
        self.network.restore(f"unit{unit}")
        self.cut.discard(unit)
        self._record(GangHeal(unit=unit))

    def crash_bootstrap(self) -> list[int]:
        if not self._rendezvous_up():
            return []
        assert self.rendezvous is not None
        pids = kill_tree(self.rendezvous.pid)
        self.rendezvous.wait()
        self._record(RendezvousCrash(pids=" ".join(map(str, pids))))
        return pids

    def recover_bootstrap(self) -> list[int]:
        return [] if self._rendezvous_up() else self._start_rendezvous()

    def _stop_over(self) -> bool:
        """Whether the graceful stop in progress is over: every rank left, one failed, or its time is up."""
        assert self.job is not None and self.job.stop_deadline is not None
        codes = [process.poll() for process in self.job.processes.values()]
        return None not in codes or any(codes) or time.monotonic() > self.job.stop_deadline

    def tick(self) -> None:
        job = self.job
        if job is not None:
            exited = {unit: code for unit, process in job.processes.items() if (code := process.poll()) is not None}
            if job.stop_deadline is not None:
                if self._stop_over():
                    self._end_job("scale_up")
            elif exited:
                for unit, code in exited.items():
                    if self.log is not None:
                        self.log.write(UnitExit(method=self.name, unit=unit, exit_code=code))
                self._end_job("failure")
            elif self.policy == "elastic" and self._rendezvous_up() and set(self.available()) - job.processes.keys():
                self._record(ScaleUp(incarnation=job.incarnation, available=" ".join(map(str, self.available()))))
                self._stop_job(self.scale_up_grace_s)
        if self.job is None:
            self._maybe_start_job()

    def finish(self) -> None:
        """Thaw frozen ranks, SIGTERM the job (ranks stop at an agreed step, checkpoint, evaluate), wait until
        every rank left, one failed or ``stop_grace_s`` passed, then SIGKILL every process left, the rendezvous store
        included."""
        for unit in list(self.frozen):
            self.thaw(unit)
        if self.job is not None:
            self._stop_job(self.stop_grace_s)
            while not self._stop_over():
                time.sleep(0.1)
            self._end_job("finish")
        if self.rendezvous is not None:
            kill_tree(self.rendezvous.pid)
            self.rendezvous.wait()
        self._record(GangFinish(incarnations=self.incarnations))
        assert self.gang_log is not None
        self.gang_log.close()

    def result(self) -> MethodResult:
        logs = [self.run_dir / f"unit{unit}" / "metrics.jsonl" for unit in range(self.units)]
        per_unit = [read_events(log, *RANK_LOG) for log in logs]
        everything = [event for events in per_unit for event in events]
        starts = {event.incarnation: event.world_size for event in everything if isinstance(event, RankStart)}
        notes = [
            f"{self.policy} policy: {len(starts)} incarnations trained, world sizes "
            + ", ".join(f"{incarnation}:{size}" for incarnation, size in sorted(starts.items()))
        ]
        evals = eval_points(everything, self.started_at)
        return MethodResult(
            self.name,
            self.budget_s,
            unit_results(per_unit),
            evals,
            evals[-1].eval_loss if evals else None,
            notes,
        )


def _free_port() -> int:
    """A TCP port free on this machine now (a node in its own network namespace has every port free)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# ------------------------------------------------------------------------------------ goodput from the logs
def kept_step_limits(events: Iterable[Event]) -> dict[int, int]:
    """For each incarnation that logged a ``start``: the last step index whose update is in the final model.

    An incarnation's steps survive up to the step the next incarnation that started resumed from (its later steps were
    lost with it: killed, or failed before a checkpoint); the last incarnation's survive up to its last checkpoint
    (after a graceful stop, its final step). A step's index is the job's step count after it.
    """
    events = list(events)
    resumed = {event.incarnation: event.resumed_step for event in events if isinstance(event, RankStart)}
    checkpoints: dict[int, int] = {}
    for event in events:
        if isinstance(event, RankCheckpoint):
            checkpoints[event.incarnation] = max(checkpoints.get(event.incarnation, 0), event.step)
    order = sorted(resumed)
    limits = {incarnation: resumed[successor] for incarnation, successor in zip(order, order[1:])}
    if order:
        last = order[-1]
        limits[last] = max(resumed[last], checkpoints.get(last, 0))
    return limits


def unit_results(events_by_unit: Sequence[Sequence[Event]]) -> list[UnitResult]:
    """Compute time and tokens of every unit's ``step`` events, all of them and those kept in the final model (see
    :func:`kept_step_limits`; the limits come from the events of all units together)."""
    limits = kept_step_limits(event for events in events_by_unit for event in events)
    results = []
    for unit, events in enumerate(events_by_unit):
        steps = [event for event in events if isinstance(event, RankStep)]
        kept = [event for event in steps if event.step <= limits.get(event.incarnation, -1)]
        results.append(
            UnitResult(
                unit,
                compute_s=sum(event.compute_s for event in steps),
                useful_compute_s=sum(event.compute_s for event in kept),
                tokens=sum(event.tokens for event in steps),
                useful_tokens=sum(event.tokens for event in kept),
            )
        )
    return results


def eval_points(events: Iterable[Event], started_at: float) -> list[EvalPoint]:
    """Rank 0's evals in time order, at seconds since ``started_at`` (a non-finite loss, logged as null, is left
    out)."""
    evals = sorted((event for event in events if isinstance(event, RankEval)), key=lambda event: event.time)
    return [
        EvalPoint(event.time - started_at, event.tokens_in_model, event.eval_loss)
        for event in evals
        if event.eval_loss is not None
    ]
