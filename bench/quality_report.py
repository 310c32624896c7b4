"""The quality bench's report: JSON, a markdown table (eval loss and its gap to data-parallel at equal tokens, in the
shape of the DiLoCo scaling-laws paper's Table 4) and a plot of eval loss against tokens."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.quality import Budget, MethodResult


def result_row(result: MethodResult) -> dict[str, Any]:
    return {**dataclasses.asdict(result), "final_loss": result.final_loss, "start_loss": result.start_loss}


def gap_percent(loss: float, reference: float) -> float:
    return 100.0 * (loss - reference) / reference


def data_parallel_loss(rows: Sequence[dict[str, Any]], units: int) -> float | None:
    """The final eval loss of data-parallel with ``units`` units' combined batch, else of the first data-parallel
    row (None without one)."""
    data_parallel = [row for row in rows if row["method"]["kind"] == "data-parallel"]
    same = [row for row in data_parallel if row["method"]["units"] == units]
    return (same or data_parallel or [{"final_loss": None}])[0]["final_loss"]


def markdown(rows: Sequence[dict[str, Any]], budget: Budget, command: str, environment: str) -> str:
    """Rows by method, the gap of each final eval loss to its start and to data-parallel's with the same units (the
    combined batch; else the first data-parallel row)."""
    lines = [
        "# Quality at equal tokens (one process, no network)", "", "Reproduce:", "", f"    {command}", "",
        environment, "",
        f"Budget: {budget.tokens:,} tokens over all units; settings {budget.settings or 'of the tiny preset'}; "
        f"seed {budget.seed}.", "",
        "| method | units | alone p | delay steps | outer | tokens | inner steps per unit | rounds | mean group "
        "| start eval loss | final eval loss | vs start | vs data-parallel (same units) | seconds |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for row in rows:
        method = row["method"]
        reference = data_parallel_loss(rows, method["units"])
        gap = "" if reference is None else f"{gap_percent(row['final_loss'], reference):+.2f}%"
        outer = ", ".join(f"{key}={value}" for key, value in method["outer"].items()) or "defaults"
        lines.append(
            f"| {method['name']} | {method['units']} | {method['alone_p']:g} | {method['delay_steps']} | {outer} "
            f"| {row['tokens']:,} | {row['inner_steps']} | {row['rounds']} | {row['mean_group']:.2f} "
            f"| {row['start_loss']:.4f} | {row['final_loss']:.4f} "
            f"| {gap_percent(row['final_loss'], row['start_loss']):+.2f}% | {gap} | {row['seconds']:.0f} |"
        )
    lines += ["", "Tokens: the budget rounded down to whole rounds of every method. Eval loss: the held-out batches "
              "every unit shares; for DiLoCo methods, that of the units' mean φ at the end (after the last rounds "
              "arrived).", ""]  # fmt: skip
    return "\n".join(lines)


def plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.4, 4.2))
    for row in rows:
        points = row["points"]
        axis.plot([p["tokens"] for p in points], [p["loss"] for p in points], marker="o", label=row["method"]["name"])
    axis.set(xlabel="tokens (all units)", ylabel="held-out eval loss", title="Eval loss at equal tokens")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_report(results: Sequence[MethodResult], budget: Budget, out: Path, command: str, environment: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows = [result_row(result) for result in results]
    document = {"command": command, "environment": environment, "budget": dataclasses.asdict(budget), "rows": rows}
    (out / "quality.json").write_text(json.dumps(document, indent=1) + "\n")
    (out / "quality.md").write_text(markdown(rows, budget, command, environment))
    plot(rows, out / "quality.png")
