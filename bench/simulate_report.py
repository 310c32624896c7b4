"""The simulator's report (bench/simulate.py): measured against simulated figures, and predictions."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

FIGURES = (("mean group", ("mean_group",)), ("member drift p50", ("member_drift", "p50")),
           ("member drift p90", ("member_drift", "p90")), ("distance p50", ("distance_during", "p50")),
           ("distance p90", ("distance_during", "p90")))  # fmt: skip
ASSUMPTIONS = """Assumptions: units are 256-dimensional vectors; an inner step pulls θ 2% toward a common target and
adds independent noise; two parameters are fitted to the reference run: the noise's size relative to the vector's
norm (to its 90th percentile of pairwise distance) and the jitter of single step times (to its mean group size: the
contention of units sharing two cores, which scatters their phases); step times, their spread between units, the
all-reduce time after the scheduled time and the eval pause after a merged round are those measured in each run
(predictions: the reference run's, i.e. units as contended as 8 on 2 cores); groups form by hivemind's rule (the
earliest scheduled unit leads the units that waited at least 1.5 s in its key, up to the target size); the
all-reduce's bytes are 2·(k−1)/k of the tiny model's fp32 φ and m per member of a group of k; the units know the
swarm's size (for the mix stage); churn replaces a leaving unit by a joiner that downloads a live unit's state; no
network failures, no partial all-reduces."""


def _get(figures: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = figures
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value if isinstance(value, int | float) else None


def _error(measured: float | None, simulated: float | None) -> float | None:
    if measured is None or simulated is None or measured == 0:
        return None
    return simulated / measured - 1


def compare_rows(checks: Sequence[tuple[dict[str, Any], dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for measured, simulated in checks:
        figures = {}
        for label, path in FIGURES:
            m, s = _get(measured, path), _get(simulated, path)
            figures[label] = {"measured": m, "simulated": s, "error": _error(m, s)}
        rows.append({"run": measured["name"], "figures": figures})
    return rows


def _num(value: float | None, spec: str = ".3g") -> str:
    return "–" if value is None else format(value, spec)


def markdown(report: dict[str, Any]) -> str:
    header = "| run | " + " | ".join(f"{label} (measured / simulated / error)" for label, _ in FIGURES) + " |"
    lines = ["# Simulated group formation and consensus", "", f"Reproduce: `{report['command']}`", "",
             f"Fitted to {report['reference']}: noise {report['noise']}, step jitter {report['step_jitter']}.", "",
             ASSUMPTIONS, "",
             "## Against the measured swarms", "", header, "|" + "---|" * (len(FIGURES) + 1)]  # fmt: skip
    for row in report["checks"]:
        cells = [f"{_num(f['measured'])} / {_num(f['simulated'])} / {_num(f['error'], '+.0%')}"
                 for f in row["figures"].values()]  # fmt: skip
        lines.append(f"| {row['run']} | " + " | ".join(cells) + " |")
    lines += ["", "## Predictions", "",
              "| units | target group | schedule | churn %/h | mean group | member drift p50 / p90 "
              "| distance p50 / p90 | final max distance | MiB sent per unit per hour |",
              "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for p in report["predictions"]:
        spec, drift, distance = p["spec"], p["member_drift"], p["distance_during"]
        lines.append(
            f"| {spec['units']} | {spec['target_group']} | {spec['schedule']} | {spec['churn_per_hour']:.0f} "
            f"| {_num(p['mean_group'])} | {_num(drift['p50'], '.1e')} / {_num(drift['p90'], '.1e')} "
            f"| {_num(distance['p50'], '.1e')} / {_num(distance['p90'], '.1e')} "
            f"| {_num(p['final_max_distance'], '.1e')} | {_num(p['bytes_sent_per_unit_per_hour'] / 2**20, '.0f')} |"
        )
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    """Measured against simulated mean group size and distance p90, one bar pair per measured run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["checks"]
    figure, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for axis, label in zip(axes, ("mean group", "distance p90")):
        names = [row["run"] for row in rows]
        for offset, source in ((-0.2, "measured"), (0.2, "simulated")):
            values = [row["figures"][label][source] or 0.0 for row in rows]
            axis.bar([i + offset for i in range(len(rows))], values, width=0.4, label=source)
        axis.set_xticks(range(len(rows)), names, rotation=30, ha="right", fontsize=8)
        axis.set_title(label)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
