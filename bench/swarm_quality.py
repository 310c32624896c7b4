"""A real swarm's model quality against synchronous DiLoCo at equal tokens (issue 34's quality target).

A swarm of the scale benchmark (bench/scale.py, its run folder kept) is read from its units' metrics logs: the
tokens every unit trained (all its inner steps, start-up included), each unit's final eval (after its last round,
reason ``final``) and, mid-run, each unit's last eval reported before the swarm's tokens reached half its total. The
in-process quality bench (bench/quality.py) then trains, with the same model, data, H, batch and inner settings (taken
from the units' run.json) and the same total tokens:

* ``diloco-m<N>``: synchronous DiLoCo of N units in lockstep, every round one group of all;
* ``async-m<N>``: the same with what the in-process bench can replay of the real swarm: the share of unit-rounds that
  ended alone and the median number of inner steps a round was in flight (its overlap), as measured in the run.

What separates the real swarm from ``async-m<N>`` is what the bench does not model: units of different speeds (each
trains its own number of steps), the start-up (units train alone until the others joined), rows split into lineages
for a period, and the partial last round. Losses are the held-out loss of the embedded corpus's eval batches; the
in-process runs are deterministic (same seed, same numbers on a rerun).
"""

from __future__ import annotations

import json
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.curves import loss_at as curve_loss_at
from bench.quality import Budget, Method, MethodResult, run_method
from p2p_diloco.unit.events import Eval, InnerStep, OuterRound, read_events

SHARED_SETTINGS = (("data", "seq_len"), ("data", "batch_size"), ("data", "eval_batches"), ("inner", "inner_lr"),
                   ("inner", "warmup_steps"), ("inner", "decay_steps"), ("inner", "weight_decay"),
                   ("inner", "grad_accum"), ("outer", "inner_steps"), ("outer", "outer_lr"),
                   ("outer", "outer_momentum"))  # fmt: skip
EVALS = 16  # eval points of the in-process methods (the mid-run comparison interpolates between them)


@dataclass(frozen=True)
class SwarmRun:
    """What a kept scale-bench run tells about its quality."""

    name: str
    units: int
    tokens: int  # every unit's inner steps × tokens per step, summed
    steps_per_unit: tuple[int, ...]
    final_evals: tuple[float, ...]
    mid_tokens: float  # the swarm's tokens when the mid-run evals were reported (their mean)
    mid_evals: tuple[float, ...]
    alone_share: float  # unit-rounds that ended alone
    overlap_steps: int  # median inner steps a round was in flight
    settings: dict[str, Any]  # section__field of the units' config that the in-process methods share


def read_swarm(run_dir: Path) -> SwarmRun:
    """The figures of a kept run folder (``unit*/metrics.jsonl`` and ``run.json``). Raises ValueError for a folder
    without units or a unit without a final eval."""
    unit_dirs = sorted(run_dir.glob("unit*/"), key=lambda path: int(path.name.removeprefix("unit")))
    if not unit_dirs:
        raise ValueError(f"{run_dir} holds no unit folder")
    config = json.loads((unit_dirs[0] / "run.json").read_text())["config"]
    settings = {f"{section}__{name}": config[section][name] for section, name in SHARED_SETTINGS}
    per_step = config["data"]["seq_len"] * config["data"]["batch_size"] * config["inner"]["grad_accum"]
    steps, finals, rounds, step_times, evals = [], [], [], [], []
    for unit_dir in unit_dirs:
        log = unit_dir / "metrics.jsonl"
        marks = read_events(log, InnerStep)
        steps.append(marks[-1].step if marks else 0)
        step_times += [mark.time for mark in marks]
        unit_evals = read_events(log, Eval)
        final = [e.eval_loss for e in unit_evals if e.reason == "final" and e.eval_loss is not None]
        if not final:
            raise ValueError(f"{unit_dir.name} has no final eval")
        finals.append(final[-1])
        evals.append([(e.time, e.eval_loss) for e in unit_evals
                      if e.reason == "outer_round" and e.eval_loss is not None])  # fmt: skip
        rounds += read_events(log, OuterRound)
    step_times.sort()
    half_at = step_times[len(step_times) // 2]  # the swarm's tokens reach half their total
    mids = [max((item for item in unit if item[0] <= half_at), default=None) for unit in evals]
    reported = [mid for mid in mids if mid is not None]
    mid_tokens = statistics.fmean(sum(t <= time for t in step_times) * per_step for time, _ in reported)
    return SwarmRun(
        name=run_dir.name,
        units=len(unit_dirs),
        tokens=sum(steps) * per_step,
        steps_per_unit=tuple(steps),
        final_evals=tuple(finals),
        mid_tokens=mid_tokens,
        mid_evals=tuple(loss for _, loss in reported),
        alone_share=sum(r.group_size == 1 for r in rounds) / max(1, len(rounds)),
        overlap_steps=round(statistics.median(r.overlap_steps for r in rounds)) if rounds else 0,
        settings=settings,
    )


def in_process(swarm: SwarmRun, seed: int = 0) -> list[MethodResult]:
    """Synchronous DiLoCo and the replayed async rounds of ``swarm.units`` units on the swarm's total tokens."""
    budget = Budget(swarm.tokens, EVALS, seed, swarm.settings)
    units = swarm.units
    methods = [Method(f"diloco-m{units}", "diloco", units),
               Method(f"async-m{units}", "diloco", units, swarm.alone_share, swarm.overlap_steps)]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="swarm-quality-") as scratch:
        return [run_method(method, budget, Path(scratch) / method.name) for method in methods]


def loss_at(result: MethodResult, tokens: float) -> float:
    """The method's eval loss at ``tokens``, linear between its eval points (held at its ends)."""
    return curve_loss_at([(point.tokens, point.loss) for point in result.points], tokens)


def comparison(swarm: SwarmRun, results: list[MethodResult]) -> dict[str, Any]:
    """The swarm's final and mid-run evals beside each in-process method's at the same tokens, and the gaps."""
    final, mid = statistics.fmean(swarm.final_evals), statistics.fmean(swarm.mid_evals)
    rows = []
    for result in results:
        at_mid = loss_at(result, swarm.mid_tokens)
        rows.append({"method": result.method.name, "tokens": result.tokens, "inner_steps": result.inner_steps,
                     "mean_group": result.mean_group, "final": result.final_loss, "mid": at_mid,
                     "swarm_final_gap": final / result.final_loss - 1, "swarm_mid_gap": mid / at_mid - 1,
                     "points": [[point.tokens, point.loss] for point in result.points]})  # fmt: skip
    return {"swarm": {**swarm.__dict__, "final": final, "mid": mid}, "in_process": rows}


def markdown(report: dict[str, Any]) -> str:
    lines = ["# A real swarm against synchronous DiLoCo at equal tokens", "", f"Reproduce: `{report['command']}`", "",
             report["environment"], "",
             "| swarm | units | tokens | steps per unit (min–max) | share of unit-rounds alone "
             "| overlap steps (median) | final eval (mean, spread) | mid-run eval (mean at tokens) | method "
             "| its final | gap | its mid-run | gap |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for entry in report["runs"]:
        swarm = entry["swarm"]
        spread = max(swarm["final_evals"]) - min(swarm["final_evals"])
        head = (
            f"| {swarm['name']} | {swarm['units']} | {swarm['tokens']:,} | {min(swarm['steps_per_unit'])}–"
            f"{max(swarm['steps_per_unit'])} | {swarm['alone_share']:.0%} | {swarm['overlap_steps']} "
            f"| {swarm['final']:.4f} ({spread:.1e}) | {swarm['mid']:.4f} at {swarm['mid_tokens']:,.0f} "
        )
        for row in entry["in_process"]:
            lines.append(f"{head}| {row['method']} | {row['final']:.4f} | {row['swarm_final_gap']:+.2%} "
                         f"| {row['mid']:.4f} | {row['swarm_mid_gap']:+.2%} |")  # fmt: skip
            head = "| | | | | | | | "
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    """Eval loss against the swarm's tokens: each in-process method's curve, the swarm's mid-run and final evals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    figure, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 3.6), squeeze=False)
    for axis, entry in zip(axes[0], runs):
        swarm = entry["swarm"]
        for row in entry["in_process"]:
            tokens, losses = zip(*row["points"][1:])
            axis.plot(tokens, losses, label=row["method"])
        axis.scatter([swarm["mid_tokens"]] * len(swarm["mid_evals"]), swarm["mid_evals"], marker="x", color="black",
                     label="real swarm, each unit")  # fmt: skip
        axis.scatter([swarm["tokens"]] * len(swarm["final_evals"]), swarm["final_evals"], marker="x", color="black")
        axis.set_title(f"{swarm['name']} ({swarm['units']} units)")
        axis.set_xlabel("tokens, all units")
        axis.set_ylabel("held-out loss")
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_report(report: dict[str, Any], out: Path) -> None:
    """swarm_quality.json, .md and .png of ``report`` in ``out`` (made if missing)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "swarm_quality.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "swarm_quality.md").write_text(markdown(report))
    plot(report, out / "swarm_quality.png")
