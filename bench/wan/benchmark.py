"""The WAN comparison: every method trains the same model on the same data, seeds and wall-time budget, one after the
other in one run and without faults, with every node (the bootstrap or rendezvous node and M units) in its own network
namespace behind one bridge and every node's link limited by tbf to ``rate_mbit`` each way. While a method runs, every
node's link counters are sampled into ``<out>/<method>/links.jsonl``; the report (``report.py``) goes to
``<out>/results.{json,md,png}``.

Methods:
* ``sync-dp``: gloo all-reduce of the gradients every step (fixed membership);
* ``sync-diloco``: blocking all-reduce of the pseudo-gradients every H steps;
* ``ours-p1``: our swarm with one fragment and fp32 proposals (plain decoupled DiLoCo);
* ``ours-streaming``: our swarm with P streaming fragments, a codec, and at most ``--max-in-flight`` rounds in flight;
* ``dp-reference``: ``sync-dp`` on 127.0.0.1 without rate limit, the data-parallel quality per token (not timed).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

from pydantic import ValidationError

from bench.chaos.benchmark import environment, rebuilt_result
from bench.chaos.gang import GangTarget, Mode
from bench.chaos.harness import run_schedule
from bench.chaos.links import LinkMonitor
from bench.chaos.namespaces import Namespaces, tbf_parameters
from bench.chaos.network import ChaosNetwork, Loopback
from bench.chaos.results import MethodResult
from bench.chaos.swarm_target import SwarmTarget
from bench.chaos.target import ChaosTarget
from bench.events import MethodLoad
from bench.training import TrainingSetup
from bench.wan.report import LINKS_FILE, QUALITY_REFERENCE, write_report
from p2p_diloco.config import OuterSection
from p2p_diloco.errors import UserError
from p2p_diloco.unit.events import read_events
from p2p_diloco.unit.metrics import MetricsLog

logger = logging.getLogger(__name__)

SWARM_METHODS = ("ours-p1", "ours-streaming")
METHODS = ("sync-dp", "sync-diloco", *SWARM_METHODS, QUALITY_REFERENCE)
SCHEDULE_FILE = "schedule.jsonl"
NAMESPACE_PREFIX = "pdw-"  # not the chaos runs' prefix, so both can run at once
STREAMING_FLAGS = ("--fragments", "--codec", "--max-in-flight")  # set per method, never by extra swarm flags


class RunFolderError(UserError):
    """The results folder does not fit the request (a new run into an earlier one, or a report with no run)."""


@dataclass(frozen=True)
class WanConfig:
    """One WAN comparison. ``fragments``, ``codec`` and ``max_in_flight`` are ours-streaming's; ``target_loss`` None
    means the report's default target; ``swarm_flags`` go to every unit of our methods (``p2p-diloco join`` flags);
    ``method_budgets_s`` gives some methods their own wall-time budget instead of ``budget_s`` (sync-dp on slow links
    needs far longer to reach a loss the others reach in minutes). Raises ValueError with a one-line message for an
    invalid value."""

    units: int
    budget_s: float
    seed: int
    rate_mbit: float
    setup: TrainingSetup
    out_dir: Path
    methods: tuple[str, ...] = METHODS
    fragments: int = 4
    codec: str = "int8"
    max_in_flight: int = 2
    target_loss: float | None = None
    swarm_flags: tuple[str, ...] = ()
    method_budgets_s: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.units < 2:
            raise ValueError(f"units must be at least 2 (a single unit sends nothing), got {self.units}")
        for name, value in [("budget_s", self.budget_s), ("rate_mbit", self.rate_mbit),
                            *((f"the budget of {m}", v) for m, v in self.method_budgets_s.items())]:  # fmt: skip
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value}")
        idle = sorted(set(self.method_budgets_s) - set(self.methods))
        if idle:
            raise ValueError(f"budgets given for methods that do not run: {idle}")
        if self.target_loss is not None and not (math.isfinite(self.target_loss) and self.target_loss > 0):
            raise ValueError(f"target_loss must be a positive number, got {self.target_loss}")
        unknown = sorted(set(self.methods) - set(METHODS))
        if unknown or not self.methods or len(set(self.methods)) != len(self.methods):
            raise ValueError(f"methods must be distinct names from {list(METHODS)}, got {list(self.methods)}")
        try:
            OuterSection(fragments=self.fragments, codec=self.codec, max_in_flight=self.max_in_flight)
        except ValidationError as error:
            first = error.errors()[0]
            raise ValueError(f"invalid {first['loc'][0]}: {first['msg']}") from None
        clashes = sorted(set(self.swarm_flags) & set(STREAMING_FLAGS))
        if clashes:
            raise ValueError(f"swarm flags must not set {clashes}: they are set per method")

    def join_flags(self, method: str) -> tuple[str, ...]:
        """The ``p2p-diloco join`` flags of our ``method`` on top of the training setup's."""
        streaming = {
            "ours-p1": ("--fragments", "1", "--codec", "fp32"),
            "ours-streaming": (
                "--fragments", str(self.fragments), "--codec", self.codec, "--max-in-flight", str(self.max_in_flight),
            ),
        }[method]  # fmt: skip
        return (*self.swarm_flags, *streaming)

    def budget_for(self, method: str) -> float:
        """``method``'s wall-time budget in seconds."""
        return self.method_budgets_s.get(method, self.budget_s)


def _target(method: str, config: WanConfig, network: ChaosNetwork, log: MetricsLog) -> ChaosTarget:
    run_dir, budget_s = config.out_dir / method, config.budget_for(method)
    if method in SWARM_METHODS:
        flags = config.join_flags(method)
        return SwarmTarget(method, config.units, run_dir, network, config.setup, budget_s, flags, log=log)
    # No faults: a collective that waited the whole budget is stuck, so that is its timeout.
    mode = "sync-dp" if method == QUALITY_REFERENCE else method
    return GangTarget(
        method, cast(Mode, mode), "fixed", config.units, run_dir, network, config.setup, budget_s, log=log,
        gloo_timeout_s=budget_s,
    )  # fmt: skip


def _nodes(config: WanConfig) -> list[str]:
    return ["bootstrap", *(f"unit{unit}" for unit in range(config.units))]


def _run_methods(config: WanConfig, network: Namespaces, log: MetricsLog) -> list[MethodResult]:
    """Every method in turn, without faults, each while a :class:`LinkMonitor` samples every node's link."""
    results = []
    for method in config.methods:
        target = _target(method, config, Loopback() if method == QUALITY_REFERENCE else network, log)
        load, budget_s = os.getloadavg()[0], config.budget_for(method)
        log.write(MethodLoad(method=method, load_average_1min=load))
        logger.info("wan method=%s budget_s=%.0f rate_mbit=%g load=%.1f", method, budget_s, config.rate_mbit, load)
        if method == QUALITY_REFERENCE:  # on 127.0.0.1: nothing crosses the emulated links
            results.append(run_schedule(target, [], budget_s, log))
            continue
        with LinkMonitor(network, _nodes(config), config.out_dir / method / LINKS_FILE):
            results.append(run_schedule(target, [], budget_s, log))
    return results


def _header(config: WanConfig, schedule_log: Path) -> dict[str, Any]:
    loads = {event.method: event.load_average_1min for event in read_events(schedule_log, MethodLoad)}
    rate_bit_s, burst_bytes, limit_bytes = tbf_parameters(config.rate_mbit)
    return {
        "environment": {
            **environment(),
            "load average (1 min) at each method's start": ", ".join(f"{m} {v:.1f}" for m, v in loads.items()),
        },
        "config": {
            "units": config.units,
            "budget_s": config.budget_s,
            "method_budgets_s": dict(config.method_budgets_s),
            "seed": config.seed,
            "rate_mbit": config.rate_mbit,
            "tbf": {"rate_bit_s": rate_bit_s, "burst_bytes": burst_bytes, "limit_bytes": limit_bytes},
            "setup": {key: str(value) for key, value in asdict(config.setup).items()},
            "methods": list(config.methods),
            "join_flags": {
                method: list(config.join_flags(method)) for method in config.methods if method in SWARM_METHODS
            },
            "target_loss": config.target_loss,
        },
    }


def run_wan_benchmark(config: WanConfig, command: list[str], report_only: bool = False) -> int:
    """Run every method of ``config`` in turn and write the report; returns 0 (the numbers are the result, the
    targets are judged in the report). With ``report_only`` nothing is run: the report is rebuilt from the logs of
    an earlier run of the same configuration in ``config.out_dir``. Raises RunFolderError when ``out_dir`` already
    holds a run (a new run would resume its checkpoints) or, with ``report_only``, no run of a method; NamespaceError
    when the namespaces cannot be created (nothing is written then)."""
    schedule_log = config.out_dir / SCHEDULE_FILE
    if report_only:
        if not schedule_log.exists():
            raise RunFolderError(f"{config.out_dir} holds no earlier run to report on")
        with MetricsLog(schedule_log) as log:
            try:
                results = [
                    rebuilt_result(_target(method, config, Loopback(), log), log.path) for method in config.methods
                ]
            except ValueError as error:
                raise RunFolderError(str(error)) from None
    else:
        if schedule_log.exists():
            raise RunFolderError(f"{config.out_dir} already holds a run; choose another --out (or add --report-only)")
        network = Namespaces(_nodes(config), prefix=NAMESPACE_PREFIX, rate_mbit=config.rate_mbit)
        try:  # the namespaces are removed whatever happens, Ctrl+C included
            with MetricsLog(schedule_log) as log:
                results = _run_methods(config, network, log)
        finally:
            network.close()
    markdown = write_report(
        config.out_dir, results, config.units, config.target_loss, command, _header(config, schedule_log)
    )
    print(markdown)
    return 0
