"""The chaos comparison: every method trains the same model on the same data, with the same M, seed, wall-time
budget and fault schedule, one after the other in one run; the results go to ``results.{json,md,png}``.

Methods:
* ``ours``: the decoupled swarm (``SwarmTarget``), no supervisor;
* ``sync-dp``: gloo all-reduce of gradients every step, fixed membership, all ranks restart from the last checkpoint
  once the failed unit is back (torchrun without elasticity);
* ``elastic-dp``: the same, restarting at once with the surviving ranks, and again when a unit comes back;
* ``sync-diloco``: our inner/outer algorithm with a blocking all-reduce every H steps that waits for every rank;
* ``dp-no-faults``: ``sync-dp`` without any fault (the quality reference);
* ``diloco-no-faults``: ``sync-diloco`` without any fault (what the DiLoCo algorithm itself reaches here).
"""

from __future__ import annotations

import logging
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import hivemind
import torch

from bench.chaos.gang import GangTarget, Mode, Policy
from bench.chaos.harness import run_schedule
from bench.chaos.namespaces import Namespaces
from bench.chaos.network import ChaosNetwork, Loopback
from bench.chaos.report import command_note, equal_tokens, loss_at_tokens, write_report
from bench.chaos.results import MethodResult
from bench.chaos.schedule import Fault, FaultRates, fraction_with_any_unit_down, poisson_schedule
from bench.chaos.swarm_target import SwarmTarget
from bench.chaos.target import ChaosTarget
from bench.events import MethodStart
from bench.training import TrainingSetup
from p2p_diloco.unit.events import read_events
from p2p_diloco.unit.metrics import MetricsLog

logger = logging.getLogger(__name__)

METHODS = ("ours", "sync-dp", "elastic-dp", "sync-diloco", "dp-no-faults", "diloco-no-faults")
FAULT_FREE = ("dp-no-faults", "diloco-no-faults")


@dataclass(frozen=True)
class ChaosConfig:
    units: int
    budget_s: float
    seed: int
    rates: FaultRates
    setup: TrainingSetup
    out_dir: Path
    methods: tuple[str, ...] = METHODS
    start_after_s: float = 30.0  # no fault before every method had time to start its processes
    use_namespaces: bool = False
    swarm_flags: tuple[str, ...] = field(default=("--allreduce-timeout-s", "10"))
    # A collective waits this long for a silent rank (torch's own default is 30 min): a straggler or a short partition
    # stalls the baselines, a crash fails them at once (the dead rank's sockets close).
    gloo_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.units < 1 or not self.budget_s > 0:
            raise ValueError(f"need units >= 1 and budget_s > 0, got units {self.units}, budget_s {self.budget_s}")
        unknown = sorted(set(self.methods) - set(METHODS))
        if unknown:
            raise ValueError(f"unknown methods {unknown}; choose from {list(METHODS)}")
        if self.rates.partition_mtbf_s is not None and not self.use_namespaces:
            raise ValueError("partitions need network namespaces (--namespaces, as root)")


def _target(method: str, config: ChaosConfig, network: ChaosNetwork, log: MetricsLog) -> ChaosTarget:
    run_dir = config.out_dir / method
    if method == "ours":
        return SwarmTarget(
            method, config.units, run_dir, network, config.setup, config.budget_s, config.swarm_flags, log=log
        )
    modes: dict[str, tuple[Mode, Policy]] = {
        "sync-dp": ("sync-dp", "fixed"),
        "elastic-dp": ("sync-dp", "elastic"),
        "sync-diloco": ("sync-diloco", "fixed"),
        "dp-no-faults": ("sync-dp", "fixed"),
        "diloco-no-faults": ("sync-diloco", "fixed"),
    }
    mode, policy = modes[method]
    return GangTarget(
        method, mode, policy, config.units, run_dir, network, config.setup, config.budget_s, log=log,
        gloo_timeout_s=config.gloo_timeout_s,
    )  # fmt: skip


def rebuilt_result(target: ChaosTarget, schedule_log: Path) -> MethodResult:
    """``target``'s result from the logs of a finished run of it (its start time is read from the schedule log).
    Raises ValueError when that log has no run of ``target.name``."""
    starts = [event.time for event in read_events(schedule_log, MethodStart) if event.method == target.name]
    if not starts:
        raise ValueError(f"{schedule_log} has no run of method {target.name!r}")
    target.started_at = starts[-1]
    return target.result()


def environment() -> dict[str, Any]:
    """Versions and machine of this run, for a report."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "hivemind": hivemind.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }


def run_chaos_benchmark(config: ChaosConfig, command: list[str], report_only: bool = False) -> int:
    """Run every method of ``config`` in turn and write the report; returns 0 (the numbers are the result, targets
    are judged in the report). Namespaces, when used, are removed on the way out. With ``report_only`` nothing is
    run: the report is rebuilt from the logs of an earlier run of the same configuration in ``config.out_dir``."""
    schedule = poisson_schedule(config.units, config.budget_s, config.rates, config.seed, config.start_after_s)
    config.out_dir.mkdir(parents=True, exist_ok=True)
    results: list[MethodResult] = []
    with MetricsLog(config.out_dir / "schedule.jsonl") as log:
        if report_only:
            results = [rebuilt_result(_target(method, config, Loopback(), log), log.path) for method in config.methods]
        else:
            nodes = ["bootstrap", *(f"unit{unit}" for unit in range(config.units))]
            network: ChaosNetwork = Namespaces(nodes) if config.use_namespaces else Loopback()
            try:
                for method in config.methods:
                    faults: list[Fault] = [] if method in FAULT_FREE else schedule
                    logger.info("chaos method=%s faults=%d budget_s=%.0f", method, len(faults), config.budget_s)
                    results.append(run_schedule(_target(method, config, network, log), faults, config.budget_s, log))
            finally:
                network.close()
    down_fraction = fraction_with_any_unit_down(schedule, config.budget_s)
    header = {
        "command": " ".join(command),
        "environment": environment(),
        "config": {
            "units": config.units,
            "budget_s": config.budget_s,
            "seed": config.seed,
            "start_after_s": config.start_after_s,
            "rates": asdict(config.rates),
            "setup": {key: str(value) for key, value in asdict(config.setup).items()},
            "namespaces": config.use_namespaces,
            "swarm_flags": list(config.swarm_flags),
        },
        "schedule": [fault.to_dict() for fault in schedule],
        "fraction_with_a_unit_down": down_fraction,
    }
    notes = _targets_md(results, down_fraction) + "\n\n" + command_note(command)
    markdown = write_report(config.out_dir, results, header, notes_md=notes)
    print(markdown)
    return 0


def _targets_md(results: list[MethodResult], down_fraction: float) -> str:
    """The issue's targets, judged on this run's numbers (methods missing from the run are skipped)."""
    by_name = {result.method: result for result in results}
    lines = [f"- Fraction of the budget with at least one unit crashed: {down_fraction:.0%}."]
    ours = by_name.get("ours")
    if ours is None:
        return "\n".join(lines)
    lines.append(f"- Goodput of ours: {ours.goodput:.1%} (target: at least 90%).")
    if "sync-dp" in by_name and by_name["sync-dp"].goodput > 0:
        ratio = ours.goodput / by_name["sync-dp"].goodput
        lines.append(f"- Goodput of ours / sync-dp: {ratio:.2f}x (target: at least 2x).")
    tokens = equal_tokens(results)
    ours_loss = loss_at_tokens(ours, tokens) if tokens is not None else None
    for reference in FAULT_FREE:
        reference_loss = loss_at_tokens(by_name[reference], tokens) if reference in by_name and tokens else None
        if ours_loss is not None and reference_loss is not None:
            target = " (target: within 2%)" if reference == "dp-no-faults" else ""
            lines.append(
                f"- Eval loss of ours at {tokens:,} tokens vs {reference}: {ours_loss:.4f} vs {reference_loss:.4f}, "
                f"{ours_loss / reference_loss - 1:+.1%}{target}."
            )
    lines += [f"- ours: {note}" for note in ours.notes]
    return "\n".join(lines)
