"""The swarm-scale benchmark's report (bench/scale.py): a markdown table, the targets' check, and plots of consensus
over time."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

COLUMNS = (
    "run", "units", "target group", "mean group (histogram)", "member drift p50 / p90 (>1e-3)",
    "distance p50 / p90 after round 3", "one model after round 3 (whole run)", "final clusters at 1e-3",
    "final max distance",
    "final eval spread (rel.)", "swarm steps/s", "MiB sent/unit", "start-up median / max s", "shutdown s",
    "errors (never retrieved / tracebacks / ERROR)",
)  # fmt: skip


def _num(value: float | None, spec: str = ".3g") -> str:
    return "–" if value is None else format(value, spec)


def row(result: dict[str, Any]) -> list[str]:
    drift, during, final_eval = result["member_drift"], result["distance_during"], result["final_eval"]
    errors = result["errors"]
    histogram = ", ".join(f"{size}: {count}" for size, count in result["group_sizes"].items())
    return [
        result["name"], str(result["units"]), str(result["target_group"]),
        f"{_num(result['mean_group'])} ({histogram})",
        f"{_num(drift['p50'], '.1e')} / {_num(drift['p90'], '.1e')} ({_num(drift['share_above_1e-3'], '.0%')})",
        f"{_num(during['p50'], '.1e')} / {_num(during['p90'], '.1e')}",
        f"{_num(result['one_model_share'], '.0%')} ({_num(result.get('one_model_share_whole'), '.0%')})",
        str(result["final_clusters"]),
        _num(result["final_max_distance"], ".1e"),
        f"{_num(final_eval['spread'], '.4f')} ({_num(final_eval['relative_spread'], '.2%')})",
        _num(result["swarm_steps_per_s"], ".1f"), _num(result["bytes_sent_per_unit"] / 2**20, ".1f"),
        f"{_num(result['startup_s']['median'], '.1f')} / {_num(result['startup_s']['max'], '.1f')}",
        _num(result["shutdown_s"], ".1f"),
        f"{errors.get('never retrieved', 0)} / {errors.get('traceback', 0)} / {errors.get('error', 0)}",
    ]  # fmt: skip


def cost_table(results: Sequence[dict[str, Any]]) -> list[str]:
    lines = ["| run | processes | threads | PSS MiB | main process cores | rest of the tree cores |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for result in results:
        cost = result["unit_cost"]
        lines.append(f"| {result['name']} | {cost['processes']:.0f} | {cost['threads']:.0f} | {cost['pss_mib']:.0f} "
                     f"| {cost['main_cores']:.3f} | {cost['background_cores']:.3f} |")  # fmt: skip
    return lines


def throughput_ratios(results: Sequence[dict[str, Any]]) -> list[str]:
    """Swarm inner steps per second against the same variant's 4-unit run."""
    lines = []
    for result in results:
        reference = next((r for r in results if r["variant"] == result["variant"] and r["units"] == 4), None)
        if reference is not None and result is not reference:
            ratio = result["swarm_steps_per_s"] / reference["swarm_steps_per_s"]
            lines.append(f"- {result['name']}: {ratio:.2f}× the swarm inner steps per second of {reference['name']}")
    return lines


def markdown(results: Sequence[dict[str, Any]], environment: str) -> str:
    commands = sorted({result.get("command", "") for result in results} - {""})
    lines = [
        "# Consensus at swarm scale (tiny model, 127.0.0.1)", "",
        "Reproduce (each run records the command that made it):", "", *(f"    {command}" for command in commands), "",
        environment, "",
        "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS),
        *("| " + " | ".join(row(result)) + " |" for result in results), "",
        "Distances are ‖φa − φb‖ / max(‖φa‖, ‖φb‖) between two units: during the run from their φ probes (1,024 fixed "
        "coordinates) every second after the median unit's third round, at the end from the full φ of the final "
        "checkpoints; one model: every pair within 1e-3. Group sizes count one per unit and merged round; member drift "
        "is that of groups of two or more.",
        "", "## Throughput", "", *throughput_ratios(results), "", "## What a unit costs (sampled mid-run, median)", "",
        *cost_table(results), "",
    ]  # fmt: skip
    return "\n".join(lines)


def plot(results: Sequence[dict[str, Any]], path: Path) -> None:
    """Max pairwise distance over time, one panel per (units, target group), a line per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["units"], r["target_group"]) for r in results})
    figure, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4), squeeze=False, sharey=True)
    for axis, (units, group) in zip(axes[0], panels):
        for result in (r for r in results if (r["units"], r["target_group"]) == (units, group)):
            points = result["timeline"]
            axis.plot([p["t"] for p in points], [max(p["max"], 1e-12) for p in points], label=result["variant"])
        axis.axhline(1e-3, color="grey", linestyle=":", linewidth=1)
        axis.set(yscale="log", title=f"{units} units, target group {group}", xlabel="seconds of training")
        axis.legend()
    axes[0][0].set_ylabel("max pairwise distance of φ")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
