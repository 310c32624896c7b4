"""Apply a fault schedule to one method under test, on the wall clock, and log what was actually executed.

Each fault has a begin action (crash, freeze, cut, bootstrap crash) at ``at_s`` and an end action (recover, thaw,
restore, bootstrap recover) at ``at_s + duration_s``. End actions falling after the budget are not run, except that
frozen units are thawed and cut links restored when the budget is over (before the target finishes). Every
action is written to the run's ``schedule.jsonl`` as it happens: planned and actual offsets, the unit, the pids
it touched.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Literal

from bench.chaos.results import MethodResult
from bench.chaos.schedule import Fault
from bench.chaos.target import ChaosTarget
from bench.events import FaultAction, MethodBudgetOver, MethodFinished, MethodStart
from p2p_diloco.unit.metrics import MetricsLog

logger = logging.getLogger(__name__)

TICK_S = 0.2


@dataclass(frozen=True)
class _Action:
    at_s: float
    phase: Literal["begin", "end"]
    fault: Fault


def _actions(schedule: list[Fault], budget_s: float) -> list[_Action]:
    actions = [_Action(fault.at_s, "begin", fault) for fault in schedule if fault.at_s < budget_s]
    actions += [_Action(fault.end_s, "end", fault) for fault in schedule if fault.end_s < budget_s]
    return sorted(actions, key=lambda action: (action.at_s, action.phase == "begin"))


def _apply(target: ChaosTarget, action: _Action) -> list[int] | None:
    fault, begin = action.fault, action.phase == "begin"
    if fault.kind == "bootstrap_crash":
        return target.crash_bootstrap() if begin else target.recover_bootstrap()
    assert fault.unit is not None
    if fault.kind == "crash":
        return target.crash(fault.unit) if begin else target.recover(fault.unit)
    if fault.kind == "straggler":
        return target.freeze(fault.unit) if begin else target.thaw(fault.unit)
    if fault.kind == "partition":
        (target.partition if begin else target.heal)(fault.unit)
        return None
    raise ValueError(f"unknown fault kind {fault.kind!r}")


def run_schedule(target: ChaosTarget, schedule: list[Fault], budget_s: float, log: MetricsLog) -> MethodResult:
    """Start ``target``, apply ``schedule`` for ``budget_s`` seconds (offsets count from the moment every process was
    launched), then finish the target and return its result. The target is finished even if an action raises."""
    target.start()
    started = time.monotonic()
    log.write(MethodStart(method=target.name, budget_s=budget_s))
    pending = _actions(schedule, budget_s)
    begun: list[Fault] = []
    try:
        while (elapsed := time.monotonic() - started) < budget_s:
            while pending and pending[0].at_s <= elapsed:
                action = pending.pop(0)
                _log(log, target, action, _apply(target, action), time.monotonic() - started)
                if action.phase == "begin":
                    begun.append(action.fault)
                else:
                    begun.remove(action.fault)
            target.tick()
            time.sleep(min(TICK_S, max(0.0, budget_s - elapsed)))
    finally:
        log.write(MethodBudgetOver(method=target.name, elapsed_s=round(time.monotonic() - started, 3)))
        for fault in begun:
            if fault.kind in ("straggler", "partition"):
                action = _Action(fault.end_s, "end", fault)
                _log(log, target, action, _apply(target, action), time.monotonic() - started)
        target.finish()
    log.write(MethodFinished(method=target.name, elapsed_s=round(time.monotonic() - started, 3)))
    return target.result()


def _log(log: MetricsLog, target: ChaosTarget, action: _Action, pids: list[int] | None, actual: float) -> None:
    log.write(
        FaultAction(
            method=target.name,
            kind=action.fault.kind,
            phase=action.phase,
            unit=action.fault.unit,
            planned_s=round(action.at_s, 3),
            actual_s=round(actual, 3),
            pids=" ".join(map(str, pids)) if pids is not None else None,
        )
    )
    logger.info(
        "fault method=%s kind=%s phase=%s unit=%s at=%.1fs pids=%s",
        target.name, action.fault.kind, action.phase, action.fault.unit, actual, pids,
    )  # fmt: skip
