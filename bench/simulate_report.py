"""The simulator's report (bench/simulate.py): measured against simulated figures, and predictions."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

FIGURES = (("mean group", ("mean_group",)), ("one-model share", ("one_model_share",)),
           ("member drift p50", ("member_drift", "p50")),
           ("member drift p90", ("member_drift", "p90")), ("distance p50", ("distance_during", "p50")),
           ("distance p90", ("distance_during", "p90")))  # fmt: skip
ASSUMPTIONS = """Assumptions: units are 256-dimensional vectors; an inner step pulls θ 2% toward a common target and
adds independent noise; three parameters are fitted: the jitter of single step times (the contention of units
sharing two cores, which scatters their phases) and the chance that a member misses its group (matchmaking races lost,
late requests, failed all-reduces), together to the reference run's mean group size and one-model share, then the
noise's size relative to the vector's norm to the 90th percentile of pairwise distance of a run with lineages (the
noise reference); "miss that fits" is the miss alone refitted to each run's one-model share; step times, their spread
between units and the all-reduce time after the scheduled time are those measured in each run (predictions: the
reference run's, i.e. units as contended as 8 on 2 cores); evaluation never pauses a unit (it runs beside the inner
steps); a unit merges and begins rounds between its inner steps; groups form by hivemind's rule in each grid row's or
column's key (the earliest scheduled unit leads the units that had begun before its scheduled time when they ask
hinted leaders, or at least 1.5 s before it otherwise, up to the group's size); the all-reduce's bytes are 2·(k−1)/k
of the tiny model's fp32 φ and m per member of a group of k; every unit reads the same census (every live unit's
record, at once); churn replaces a leaving unit by a joiner that downloads a live unit's state; no partial
all-reduces, no timeouts (a missed group ends alone at once), no period inflated by them."""


def _get(figures: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = figures
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value if isinstance(value, int | float) else None


def _error(measured: float | None, simulated: float | None) -> float | None:
    if measured is None or simulated is None or measured == 0:
        return None
    return simulated / measured - 1


def compare_rows(checks: Sequence[tuple[dict[str, Any], dict[str, Any]]], misses: dict[str, float]) -> list[dict]:
    """Per measured run: each figure measured, simulated and the relative error, and the miss that fits its one-model
    share (``misses``, by run name)."""
    rows = []
    for measured, simulated in checks:
        figures = {}
        for label, path in FIGURES:
            m, s = _get(measured, path), _get(simulated, path)
            figures[label] = {"measured": m, "simulated": s, "error": _error(m, s)}
        rows.append({"run": measured["name"], "figures": figures, "implied_miss": misses[measured["name"]]})
    return rows


def _num(value: float | None, spec: str = ".3g") -> str:
    return "–" if value is None else format(value, spec)


def markdown(report: dict[str, Any]) -> str:
    header = "| run | " + " | ".join(f"{label} (measured / simulated / error)" for label, _ in FIGURES)
    header += " | miss that fits |"
    lines = ["# Simulated group formation and consensus", "", f"Reproduce: `{report['command']}`", "",
             f"Fitted: step jitter {report['step_jitter']} and miss {report['miss']} to {report['reference']}, "
             f"noise {report['noise']} to {report['noise_reference']}.", "",
             ASSUMPTIONS, "",
             "## Against the measured swarms", "", header, "|" + "---|" * (len(FIGURES) + 2)]  # fmt: skip
    for row in report["checks"]:
        cells = [f"{_num(f['measured'])} / {_num(f['simulated'])} / {_num(f['error'], '+.0%')}"
                 for f in row["figures"].values()]  # fmt: skip
        lines.append(f"| {row['run']} | " + " | ".join(cells) + f" | {row['implied_miss']} |")
    lines += ["", "## Predictions", "",
              "| units | target group | schedule | churn %/h | mean group | one-model share after round 3 "
              "| joins: rounds until in the largest lineage (p50 / max; never) | distance p50 / p90 "
              "| final max distance | MiB sent per unit per hour |",
              "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for p in report["predictions"]:
        spec, distance, joins = p["spec"], p["distance_during"], p["catch_up_rounds"]
        caught = f"{_num(joins['p50'])} / {_num(joins['max'])}; {joins['never']}" if joins["joins"] else "no join"
        lines.append(
            f"| {spec['units']} | {spec['target_group']} | {spec['schedule']} | {spec['churn_per_hour']:.0f} "
            f"| {_num(p['mean_group'])} | {_num(p['one_model_share'], '.0%')} | {caught} "
            f"| {_num(distance['p50'], '.1e')} / {_num(distance['p90'], '.1e')} "
            f"| {_num(p['final_max_distance'], '.1e')} | {_num(p['bytes_sent_per_unit_per_hour'] / 2**20, '.0f')} |"
        )
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    """Measured against simulated mean group size and one-model share, one bar pair per measured run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["checks"]
    figure, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for axis, label in zip(axes, ("mean group", "one-model share")):
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
