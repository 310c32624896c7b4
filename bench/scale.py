"""Consensus at swarm scale: N learning units of the tiny preset on this machine (127.0.0.1), side by side with
today's behaviour, and what each unit costs.

A run starts a bootstrap node and N units at once, waits until every unit joined, lets the swarm train for
``duration_s`` more seconds, then stops every unit at once (SIGTERM: each hands over its last steps, settles and
exports, as after Ctrl+C). Variants (:data:`VARIANTS`): ``steps``, today's behaviour (a round H of the unit's own steps
after its previous one, no settle rounds at exit); ``settle``, the same with the settle rounds at exit (the defaults);
``clock``, the shared-clock schedule with settle rounds.

Measured per run, from the units' metrics logs, stdout logs and final checkpoints (:func:`measure_run`):
group sizes (one count per unit and merged round), member drift of groups of two or more, pairwise relative distance
‖φa − φb‖ / max(‖φa‖, ‖φb‖) between units over time (from their ``model_probe`` events: φ at 1,024 fixed coordinates)
and at the end (full φ of the final checkpoints), clusters at 1e-3, the share of time every unit held one model (one
cluster) after the median unit's third round and over the whole run, final eval spread, inner steps, the swarm's inner
steps per second while every unit trained, bytes sent per unit, start-up and shutdown times, error lines in the logs,
and per unit (sampled mid-run) its processes, threads, memory (PSS) and CPU split between the main process and the
rest of its tree.
"""

from __future__ import annotations

import math
import re
import shutil
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.process_memory import sample_tree
from bench.swarm import Swarm
from p2p_diloco.checkpoint import load_checkpoint
from p2p_diloco.consensus import lineage_sizes, pairwise_distances
from p2p_diloco.unit.events import (
    ConsensusRound,
    Eval,
    InnerStep,
    Join,
    ModelProbe,
    OuterRound,
    OuterRoundBegin,
    Stop,
    read_events,
)

VARIANTS: dict[str, tuple[str, ...]] = {
    "steps": ("--schedule", "steps", "--settle-rounds", "0"),  # today's behaviour
    "settle": ("--schedule", "steps"),  # today's schedule with the default settle rounds at exit
    "clock": ("--schedule", "clock"),  # the shared clock, with the default settle rounds
}
JOIN_TIMEOUT_S = 300.0
STOP_GRACE_S = 180.0
TIMELINE_STEP_S = 1.0
ERROR_PATTERNS = {
    "never retrieved": re.compile(r"Task exception was never retrieved"),
    "traceback": re.compile(r"^Traceback"),
    "error": re.compile(r"\bERROR\b|\[ERROR\]"),
    "warning": re.compile(r"\bWARN(ING)?\b|\[WARN"),
}


@dataclass(frozen=True)
class RunSpec:
    units: int
    target_group: int
    variant: str

    @property
    def name(self) -> str:
        return f"{self.variant}-n{self.units}-g{self.target_group}"


# ------------------------------------------------------------------------------------------------------ running
def run_swarm(spec: RunSpec, root: Path, duration_s: float, flags: Sequence[str] = ()) -> dict[str, Any]:
    """Run one swarm under ``root / spec.name`` and return what only the running swarm can tell (times, exit codes,
    costs); :func:`measure_run` reads the rest from its files. Raises AssertionError when a unit fails to join."""
    run_dir = root / spec.name
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh swarm: no checkpoint, log or key of an earlier run
    unit_flags = ["--target-group-size", str(spec.target_group), *VARIANTS[spec.variant], *flags]
    swarm = Swarm(run_dir, run_id=spec.name, unit_flags=unit_flags)
    names = [f"unit{index}" for index in range(spec.units)]
    try:
        maddr = swarm.bootstrap("bootstrap")
        spawned = {}
        for name in names:
            spawned[name] = time.time()
            swarm.unit(name, [maddr], duration_s=duration_s + JOIN_TIMEOUT_S + 600.0)
        swarm.wait_for(lambda: all(swarm.events(name, Join) for name in names), JOIN_TIMEOUT_S, "every unit to join")
        all_joined = time.time()
        time.sleep(duration_s / 2)  # the benchmark's fixed training length: nothing to wait for but time
        costs = {name: tree_cost(swarm.processes[name].pid) for name in names}
        cpu_start = {name: cost.pop("cpu") for name, cost in costs.items()}
        time.sleep(duration_s / 2)
        cpu_end = {name: tree_cost(swarm.processes[name].pid)["cpu"] for name in names}
        stop_signal = time.time()
        exit_codes = swarm.stop(names, grace_s=STOP_GRACE_S)
        exited = time.time()
    finally:
        swarm.close()
    return {
        "spec": spec.__dict__,
        "spawned": spawned,
        "all_joined": all_joined,
        "stop_signal": stop_signal,
        "all_exited": exited,
        "exit_codes": dict(zip(names, exit_codes)),
        "costs": {name: {**costs[name], **cpu_split(cpu_start[name], cpu_end[name], duration_s / 2)} for name in names},
    }


def tree_cost(pid: int) -> dict[str, Any]:
    """Processes, threads and PSS (MiB) of ``pid``'s process tree, and each process's CPU seconds so far."""
    samples = sample_tree(pid)
    return {
        "processes": len(samples),
        "threads": sum(sample.threads for sample in samples),
        "pss_mib": sum(sample.pss for sample in samples) / 2**20,
        "cpu": {sample.pid: (sample.cpu_s, sample.pid == pid) for sample in samples},
    }


def cpu_split(start: dict[int, tuple[float, bool]], end: dict[int, tuple[float, bool]], seconds: float) -> dict:
    """Cores used by the main process and by the rest of the tree between two samples ``seconds`` apart."""
    main = rest = 0.0
    for pid, (total, is_main) in end.items():
        used = total - start.get(pid, (0.0, is_main))[0]
        main, rest = (main + used, rest) if is_main else (main, rest + used)
    return {"main_cores": main / seconds, "background_cores": rest / seconds}


# ---------------------------------------------------------------------------------------------------- measuring
def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def timeline(probes: dict[str, list[ModelProbe]], start: float, end: float) -> list[dict[str, Any]]:
    """Every TIMELINE_STEP_S from ``start`` to ``end``: each unit's latest φ probe, their max pairwise distance and
    clusters (units without a probe yet are left out)."""
    points = []
    t = start
    while t <= end:
        latest = [next((p for p in reversed(unit) if p.time <= t), None) for unit in probes.values()]
        vectors = [torch.tensor(p.values, dtype=torch.float64) for p in latest if p is not None]
        distances = pairwise_distances(vectors)
        points.append({"t": t - start, "max": max(distances, default=0.0), "distances": distances,
                       "clusters": lineage_sizes(len(vectors), distances)})  # fmt: skip
        t += TIMELINE_STEP_S
    return points


def one_model_share(points: Sequence[dict[str, Any]], from_s: float) -> float | None:
    """The share of the timeline's points from ``from_s`` (seconds after its start) where every unit held one model
    (one cluster at 1e-3); None without such points."""
    after = [point for point in points if point["t"] >= from_s]
    return sum(len(point["clusters"]) == 1 for point in after) / len(after) if after else None


def log_errors(path: Path) -> dict[str, int]:
    counts = dict.fromkeys(ERROR_PATTERNS, 0)
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            for kind, pattern in ERROR_PATTERNS.items():
                counts[kind] += bool(pattern.search(line))
    return counts


def measure_run(run_dir: Path, raw: dict[str, Any]) -> dict[str, Any]:
    """The run's figures (see the module docstring) from its files and ``raw`` (what :func:`run_swarm` returned)."""
    names = sorted(raw["exit_codes"], key=lambda name: int(name.removeprefix("unit")))
    logs = {name: run_dir / name / "metrics.jsonl" for name in names}
    rounds = {name: read_events(logs[name], OuterRound) for name in names}
    probes = {name: read_events(logs[name], ModelProbe) for name in names}
    start, stop = raw["all_joined"], raw["stop_signal"]
    group_sizes = Counter(r.group_size for name in names for r in rounds[name] if start <= r.time <= stop)
    drifts = [r.member_drift for name in names for r in rounds[name] if r.group_size > 1 and start <= r.time <= stop]
    points = timeline(probes, start, stop)
    settled = _after_round(rounds, 3, start)
    during = [d for point in points if point["t"] + start >= settled for d in point["distances"]]
    finals = [_final_phi(run_dir / name) for name in names]
    final_vectors = [vector for vector in finals if vector is not None]
    final_distances = pairwise_distances(final_vectors)
    finals_evals = [e.eval_loss for name in names for e in read_events(logs[name], Eval)[-1:] if e.reason == "final"]
    evals: list[float] = [loss for loss in finals_evals if loss is not None]
    stops = {name: read_events(logs[name], Stop) for name in names}
    joins = {name: read_events(logs[name], Join) for name in names}
    errors = Counter[str]()
    for name in names:
        errors.update(log_errors(run_dir / name / "stdout.log"))
    window = stop - start
    steps_in_window = [_steps_between(read_events(logs[name], InnerStep), start, stop) for name in names]
    costs = raw["costs"].values()
    settles = [c for name in names for c in read_events(logs[name], ConsensusRound) if c.kind == "settle"]
    return {
        "name": RunSpec(**raw["spec"]).name,
        **raw["spec"],
        "train_window_s": window,
        "group_sizes": dict(sorted(group_sizes.items())),
        "mean_group": _mean_group(group_sizes),
        "member_drift": {"p50": percentile(drifts, 0.5), "p90": percentile(drifts, 0.9),
                         "share_above_1e-3": sum(d > 1e-3 for d in drifts) / len(drifts) if drifts else None},
        "distance_during": {"p50": percentile(during, 0.5), "p90": percentile(during, 0.9), "from_s": settled - start},
        "one_model_share": one_model_share(points, settled - start),
        "one_model_share_whole": one_model_share(points, 0.0),
        "final_clusters": lineage_sizes(len(final_vectors), final_distances),
        "final_max_distance": max(final_distances, default=0.0),
        "final_eval": {"mean": statistics.fmean(evals) if evals else None,
                       "spread": max(evals) - min(evals) if evals else None,
                       "relative_spread": (max(evals) - min(evals)) / statistics.fmean(evals) if evals else None},
        "inner_steps_per_unit": [s[-1].inner_step if s else None for s in stops.values()],
        "swarm_steps_per_s": sum(steps_in_window) / window,
        "bytes_sent_per_unit": statistics.median([s[-1].wire_bytes_sent or 0 for s in stops.values() if s] or [0]),
        "startup_s": {"median": statistics.median(_startups(raw, joins)), "max": max(_startups(raw, joins))},
        "shutdown_s": raw["all_exited"] - stop,
        "exit_codes": raw["exit_codes"],
        "settle_rounds": {"count": len(settles), "applied": sum(c.applied for c in settles)},
        "errors": dict(errors),
        "unit_cost": {key: statistics.median(cost[key] for cost in costs)
                      for key in ("processes", "threads", "pss_mib", "main_cores", "background_cores")},
        "timeline": [{"t": p["t"], "max": p["max"], "clusters": p["clusters"]} for p in points],
        "timings": measured_timings(run_dir, start, stop),
    }  # fmt: skip


def measured_timings(run_dir: Path, start: float, stop: float) -> dict[str, float]:
    """What the simulator (bench/simulate.py) takes from a measured run between ``start`` and ``stop`` (unix times):
    the median seconds per inner step, the log-normal spread of the units' step times and the all-reduce time after
    the scheduled time (groups of two, and per extra member)."""
    step_times, latencies = [], []
    for log in sorted(run_dir.glob("unit*/metrics.jsonl")):
        marks = [m for m in read_events(log, InnerStep) if start <= m.time <= stop]
        if len(marks) >= 2:
            step_times.append((marks[-1].time - marks[0].time) / (marks[-1].step - marks[0].step))
        begins = {b.time: b for b in read_events(log, OuterRoundBegin)}
        rounds = [r for r in read_events(log, OuterRound) if start <= r.time <= stop]
        for merged in rounds:
            begin = max((t for t in begins if t <= merged.time), default=None)
            if begin is not None and merged.group_size > 1:
                latencies.append((merged.group_size, merged.time - begins[begin].scheduled_at))
    pairs = [seconds for size, seconds in latencies if size == 2] or [s for _, s in latencies]
    slope = statistics.median([(s - statistics.median(pairs)) / (k - 2) for k, s in latencies if k > 2] or [0.0])
    logs = [math.log(t) for t in step_times]
    return {
        "step_time_s": statistics.median(step_times),
        "step_spread": statistics.pstdev(logs) if len(logs) > 1 else 0.0,
        "latency_s": max(0.1, statistics.median(pairs)),
        "latency_per_member_s": max(0.0, slope),
    }


def _final_phi(unit_dir: Path) -> torch.Tensor | None:
    checkpoint = load_checkpoint(unit_dir / "checkpoint.pt")
    if checkpoint is None:
        return None
    return torch.cat([tensor.reshape(-1).double() for tensor in checkpoint["global_params"]])


def _after_round(rounds: dict[str, list[OuterRound]], count: int, start: float) -> float:
    """When the median unit merged its ``count``-th round after ``start``."""
    times = [r[count - 1].time for r in ([e for e in unit if e.time >= start] for unit in rounds.values()) if
             len(r) >= count]  # fmt: skip
    return statistics.median(times) if times else start


def _steps_between(marks: list[InnerStep], start: float, stop: float) -> int:
    inside = [mark.step for mark in marks if start <= mark.time <= stop]
    return max(inside) - min(inside) if len(inside) >= 2 else 0


def _mean_group(sizes: Counter[int]) -> float | None:
    total = sum(sizes.values())
    return sum(size * count for size, count in sizes.items()) / total if total else None


def _startups(raw: dict[str, Any], joins: dict[str, list[Join]]) -> list[float]:
    return [joins[name][0].time - raw["spawned"][name] for name in joins if joins[name]] or [0.0]
