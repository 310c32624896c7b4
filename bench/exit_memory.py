"""A swarm's memory at its common stop against its memory while training.

A bootstrap node and ``units`` learning units of the same flags and ``--stop-at`` (so they stop together, as a
run's units do when the run ends) run on this machine as real processes (bench/swarm.py). Every SAMPLE_EVERY_S each
unit's process tree is sampled (the sum of PSS over its main process, hivemind's forked children, p2pd and the
watchdog: bench/process_memory.py), and so is the machine's available memory. A unit's samples before its log says
it is finishing (departure.py's first line, EXIT_MARKER) count as training, the rest as its exit. Samples a second
apart can miss a peak shorter than that, so the main process's peak RSS is also read from the kernel, which keeps it
without gaps (VmHWM): read when the exit starts (the training peak), then reset (``clear_refs``) and read again until
the unit ends (the exit's peak); RSS counts shared pages whole, so these are higher than the PSS figures. A unit passes
when it exits 0, its export exists, and its exit peak is at most its training peak (both measures).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from bench.process_memory import sample_tree
from bench.swarm import Swarm
from p2p_diloco.unit.events import Eval, OuterRound, Stop, read_events

SAMPLE_EVERY_S = 1.0
TIMELINE_EVERY_S = 1.0
EXIT_MARKER = "finishing the last outer rounds"
EXPORT_FILE = "model.safetensors"
MIB = 2**20


@dataclass
class UnitWatch:
    """One unit's memory over the run, split at its exit (the first sample after EXIT_MARKER in its log)."""

    log: Path
    exit_at: float | None = None  # unix time the marker was first seen
    training_peak: int = 0
    exit_peak: int = 0
    exit_peak_at: float | None = None
    training_peak_by_kind: dict[str, int] = field(default_factory=dict)  # PSS by process kind at the peak
    exit_peak_by_kind: dict[str, int] = field(default_factory=dict)
    training_main_hwm: int = 0  # the main process's VmHWM when the exit started
    exit_main_hwm: int = 0  # ... and since, after a reset
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (unix time, tree PSS)

    def add(self, pid: int, now: float) -> None:
        samples = sample_tree(pid)
        pss = sum(sample.pss for sample in samples)
        if pss == 0:
            return
        by_kind: dict[str, int] = {}
        for sample in samples:
            by_kind[sample.kind] = by_kind.get(sample.kind, 0) + sample.pss
        if self.exit_at is None and self.log.exists() and EXIT_MARKER in self.log.read_text(errors="replace"):
            self.exit_at, self.training_main_hwm = now, samples[0].rss_peak
            Path(f"/proc/{pid}/clear_refs").write_text("5")  # the kernel's peak RSS starts over
        elif self.exit_at is not None:
            self.exit_main_hwm = max(self.exit_main_hwm, samples[0].rss_peak)
        if self.exit_at is None and pss > self.training_peak:
            self.training_peak, self.training_peak_by_kind = pss, by_kind
        elif self.exit_at is not None and pss > self.exit_peak:
            self.exit_peak, self.exit_peak_at, self.exit_peak_by_kind = pss, now, by_kind
        if not self.timeline or now - self.timeline[-1][0] >= TIMELINE_EVERY_S:
            self.timeline.append((round(now, 2), pss))


def run_swarm(root: Path, flags: list[str], units: int, train_s: float, timeout_s: float) -> dict[str, Any]:
    """Run the swarm to its common stop ``train_s`` after the units start (see the module docstring) under ``root``;
    returns every unit's figures. Every process started is gone when this returns or raises."""
    names = [f"unit{index}" for index in range(units)]
    swarm = Swarm(root, run_id=f"exit-memory-{int(time.time())}")
    watches = {name: UnitWatch(root / name / "stdout.log") for name in names}
    lowest_available = psutil.virtual_memory().available
    started = time.time()
    stop_at = started + train_s
    try:
        bootstrap = swarm.bootstrap("bootstrap")
        for name in names:
            own = (
                "--stop-at",
                f"{stop_at:.0f}",
                "--save-dir",
                str(root / name / "export"),
                "--identity-path",
                str(root / name / "peer.key"),
            )  # a preset's own identity path is one peer's
            swarm.unit(name, [bootstrap], *flags, *own, duration_s=timeout_s)
        deadline = time.monotonic() + timeout_s
        while any(swarm.running(name) for name in names) and time.monotonic() < deadline:
            now = time.time()
            for name in names:
                process = swarm.processes[name]
                if process.poll() is None:
                    with contextlib.suppress(psutil.Error):
                        watches[name].add(process.pid, now)
            lowest_available = min(lowest_available, psutil.virtual_memory().available)
            time.sleep(SAMPLE_EVERY_S)
        codes = {name: swarm.processes[name].poll() for name in names}
    finally:
        swarm.close()
    return {
        "started": started,
        "stop_at": stop_at,
        "wall_s": time.time() - started,
        "lowest_available": lowest_available,
        "total_memory": psutil.virtual_memory().total,
        "units": {name: _unit_record(root / name, watches[name], codes[name]) for name in names},
    }


def _unit_record(work_dir: Path, watch: UnitWatch, code: int | None) -> dict[str, Any]:
    metrics = work_dir / "metrics.jsonl"
    stops = read_events(metrics, Stop)
    finals = [event for event in read_events(metrics, Eval) if event.reason == "final"]
    return {
        "exit_code": code,
        "exported": (work_dir / "export" / EXPORT_FILE).exists(),
        "checkpoint": (work_dir / "checkpoint.pt").exists(),
        "training_peak": watch.training_peak,
        "exit_peak": watch.exit_peak,
        "training_peak_by_kind": watch.training_peak_by_kind,
        "exit_peak_by_kind": watch.exit_peak_by_kind,
        "training_main_hwm": watch.training_main_hwm,
        "exit_main_hwm": watch.exit_main_hwm,
        "exit_over_training": watch.exit_peak / watch.training_peak if watch.training_peak else None,
        "exit_at": watch.exit_at,
        "exit_peak_at": watch.exit_peak_at,
        "exit_s": stops[-1].time - watch.exit_at if stops and watch.exit_at else None,
        "inner_steps": stops[-1].inner_step if stops else None,
        "rounds": len(read_events(metrics, OuterRound)),
        "final_eval": finals[-1].eval_loss if finals else None,
        "timeline": watch.timeline,
    }


def passed(unit: dict[str, Any]) -> bool:
    """Exit 0, export written, exit peak at most the training peak (the tree's sampled PSS and the main process's
    kernel high-water mark)."""
    within = unit["exit_peak"] <= unit["training_peak"] and unit["exit_main_hwm"] <= unit["training_main_hwm"]
    return unit["exit_code"] == 0 and unit["exported"] and within


def markdown(report: dict[str, Any]) -> str:
    """The report's table, with the command that made it."""
    rows = [
        f"Reproduce with:\n\n```\n{report['command']}\n```\n",
        f"{report['environment']}; {len(report['units'])} units started together, stopping {report['train_s']:.0f} s "
        f"after, flags "
        f"`{' '.join(report['flags'])}`. Lowest available memory of the machine during the run: "
        f"{report['lowest_available'] / MIB:,.0f} MiB of {report['total_memory'] / MIB:,.0f} MiB.\n",
        "| unit | exit code | export | training peak MiB | exit peak MiB | exit / training | main VmHWM training MiB "
        "| main VmHWM exit MiB | exit / training | exit took s | inner steps | rounds | final eval | passed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, unit in report["units"].items():
        ratio = f"{unit['exit_over_training']:.3f}" if unit["exit_over_training"] else "n/a"
        hwm = unit["training_main_hwm"]
        hwm_ratio = f"{unit['exit_main_hwm'] / hwm:.3f}" if hwm else "n/a"
        took = f"{unit['exit_s']:.0f}" if unit["exit_s"] is not None else "n/a"
        final = f"{unit['final_eval']:.4f}" if unit["final_eval"] is not None else "n/a"
        rows.append(
            f"| {name} | {unit['exit_code']} | {'yes' if unit['exported'] else 'no'} | "
            f"{unit['training_peak'] / MIB:,.0f} | {unit['exit_peak'] / MIB:,.0f} | {ratio} | "
            f"{unit['training_main_hwm'] / MIB:,.0f} | {unit['exit_main_hwm'] / MIB:,.0f} | {hwm_ratio} | {took} | "
            f"{unit['inner_steps']} | {unit['rounds']} | {final} | {'yes' if passed(unit) else 'no'} |"
        )
    return "\n".join(rows)


def plot(report: dict[str, Any], path: Path) -> None:
    """Every unit's tree PSS over time, its exit marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4))
    for name, unit in report["units"].items():
        times = [t - report["started"] for t, _ in unit["timeline"]]
        line = axis.plot(times, [pss / MIB for _, pss in unit["timeline"]], label=name)[0]
        if unit["exit_at"] is not None:
            axis.axvline(unit["exit_at"] - report["started"], color=line.get_color(), linestyle=":")
    axis.set_xlabel("seconds since start (dotted: the unit starts its exit)")
    axis.set_ylabel("PSS of the unit's process tree (MiB)")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
