"""The long-horizon bench's report (bench/horizon.py): JSON, a markdown table in the shape of the DiLoCo scaling-laws
paper's Table 4 (each method's final eval loss per seed, and its gap to data-parallel of the same seed, with the
median over seeds) and a plot of the median eval loss against tokens. Reports of several runs merge into one when
their horizons and models are the same."""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.curves import first_reach, loss_at
from bench.horizon import Horizon, SeededResult
from bench.quality_report import gap_percent, result_row

REPORT = "horizon.json"
PENALTY_AT = (0.1, 0.25, 0.5, 1.0)  # of the run's tokens: where data-parallel's loss sets the token-penalty targets


def document(results: Sequence[SeededResult], horizon: Horizon, parameters: int, command: str,
             environment: str) -> dict[str, Any]:  # fmt: skip
    rows = [{"seed": done.seed, **result_row(done.result)} for done in results]
    return {"commands": [command], "environment": environment, "horizon": dataclasses.asdict(horizon),
            "parameters": parameters, "rows": rows}  # fmt: skip


def merge(documents: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One document of several runs of the same horizon and model: their commands and rows (a later run's row of the
    same method and seed replaces an earlier one). Raises ValueError when the horizons or models differ."""
    first = documents[0]
    for other in documents[1:]:
        if (_horizon(other), other["parameters"]) != (_horizon(first), first["parameters"]):
            raise ValueError("the reports to merge were run at different horizons or on different models")
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for each in documents:
        rows.update({(row["method"]["name"], row["seed"]): row for row in each["rows"]})
    commands = [command for each in documents for command in each["commands"]]
    return {**first, "commands": commands, "rows": list(rows.values())}


def _horizon(doc: dict[str, Any]) -> Horizon:
    """A report's horizon, fields it predates at their defaults (a report written before a field was added still
    merges with one written after)."""
    return Horizon(**doc["horizon"])


def method_names(doc: dict[str, Any]) -> list[str]:
    return list(dict.fromkeys(row["method"]["name"] for row in doc["rows"]))


def final_losses(doc: dict[str, Any], name: str) -> dict[int, float]:
    """Seed → final eval loss of method ``name``."""
    return {row["seed"]: row["final_loss"] for row in doc["rows"] if row["method"]["name"] == name}


def gaps(doc: dict[str, Any], name: str, reference: str) -> dict[int, float]:
    """Seed → gap (%) of ``name``'s final eval loss to ``reference``'s of the same seed (seeds both ran)."""
    own, base = final_losses(doc, name), final_losses(doc, reference)
    return {seed: gap_percent(loss, base[seed]) for seed, loss in own.items() if seed in base}


def _curve(row: dict[str, Any]) -> list[tuple[float, float]]:
    return [(point["tokens"], point["loss"]) for point in row["points"]]


def token_penalties(doc: dict[str, Any], name: str, reference: str) -> list[float | None]:
    """For each fraction f of PENALTY_AT: the tokens method ``name`` needed to reach ``reference``'s eval loss at f of
    the run's tokens, over f times those tokens (1: as token-efficient as data-parallel there), the median over the
    seeds both ran; None where a seed never reached it (no median of a censored sample)."""
    curves = {row["seed"]: _curve(row) for row in doc["rows"] if row["method"]["name"] == name}
    base = {row["seed"]: (_curve(row), row["tokens"]) for row in doc["rows"] if row["method"]["name"] == reference}
    penalties: list[float | None] = []
    for fraction in PENALTY_AT:
        ratios = []
        for seed in sorted(set(curves) & set(base)):
            base_curve, base_tokens = base[seed]
            at = fraction * base_tokens
            needed = first_reach(curves[seed], loss_at(base_curve, at))
            ratios.append(None if needed is None else needed / at)
        known = [ratio for ratio in ratios if ratio is not None]
        penalties.append(statistics.median(known) if known and len(known) == len(ratios) else None)
    return penalties


def data_parallel_name(doc: dict[str, Any]) -> str | None:
    return next((row["method"]["name"] for row in doc["rows"] if row["method"]["kind"] == "data-parallel"), None)


def markdown(doc: dict[str, Any]) -> str:
    horizon, parameters = doc["horizon"], doc["parameters"]
    first = doc["rows"][0]
    tokens, steps = first["tokens"], first["inner_steps"]
    reference = data_parallel_name(doc)
    lines = ["# Quality at a long horizon (one process per method and seed, no network)", "", "Reproduce:", ""]
    lines += [f"    {command}" for command in doc["commands"]]
    lines += [
        "", doc["environment"], "",
        f"Model: {parameters:,} trained parameters; {tokens:,} tokens ({tokens / parameters:.1f} per parameter); "
        f"global batch {horizon['global_batch']} sequences per inner step split among a method's units; "
        f"{steps} inner steps, H = {horizon['inner_steps']} ({steps // horizon['inner_steps']} rounds per unit); "
        f"settings {horizon['settings']}.", "",
        "| method | units | outer | alone p | delay steps | final eval loss by seed | median | "
        f"vs {reference or 'data-parallel'} by seed | median gap |",
        "|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for name in method_names(doc):
        method = next(row["method"] for row in doc["rows"] if row["method"]["name"] == name)
        losses = final_losses(doc, name)
        outer = ", ".join(f"{key}={value}" for key, value in method["outer"].items()) or "defaults"
        by_seed = " / ".join(f"{losses[seed]:.4f}" for seed in sorted(losses))
        gap_text, median_gap = "", ""
        if reference is not None and name != reference:
            seeded = gaps(doc, name, reference)
            gap_text = " / ".join(f"{seeded[seed]:+.2f}%" for seed in sorted(seeded))
            median_gap = f"{statistics.median(seeded.values()):+.2f}%" if seeded else ""
        lines.append(
            f"| {name} | {method['units']} | {outer} | {method['alone_p']:g} | {method['delay_steps']} | {by_seed} "
            f"| {statistics.median(losses.values()):.4f} | {gap_text} | {median_gap} |"
        )
    lines += ["", "Eval loss: the held-out batches every unit shares; for DiLoCo methods, that of the units' mean φ "
              "at the end (after the last rounds arrived). Seeds in increasing order.", ""]  # fmt: skip
    if reference is not None:
        lines += _penalty_lines(doc, reference)
    return "\n".join(lines)


def _penalty_lines(doc: dict[str, Any], reference: str) -> list[str]:
    fractions = " / ".join(f"{fraction:.0%}" for fraction in PENALTY_AT)
    lines = [
        f"Tokens to {reference}'s eval loss at {fractions} of the run's tokens, over the tokens {reference} needed "
        "(median over seeds, curves interpolated between evals; n/a: a seed never got there):", "",
        f"| method | {' | '.join(f'at {fraction:.0%}' for fraction in PENALTY_AT)} |",
        "|---|" + "---|" * len(PENALTY_AT),
    ]  # fmt: skip
    for name in method_names(doc):
        if name != reference:
            cells = ["n/a" if ratio is None else f"{ratio:.2f}×" for ratio in token_penalties(doc, name, reference)]
            lines.append(f"| {name} | {' | '.join(cells)} |")
    return [*lines, ""]


def plot(doc: dict[str, Any], path: Path) -> None:
    """Median over seeds of each method's eval loss against tokens, the second half of training enlarged."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in method_names(doc):
        runs = [row["points"] for row in doc["rows"] if row["method"]["name"] == name]
        tokens = [point["tokens"] for point in runs[0]]
        median = [statistics.median(run[index]["loss"] for run in runs) for index in range(len(tokens))]
        for axis in axes:
            axis.plot(tokens, median, marker=".", label=name)
    half = len(tokens) // 2
    axes[1].set_xlim(left=tokens[half])
    axes[1].set_ylim(top=statistics.median(row["points"][half]["loss"] for row in doc["rows"]) * 1.02)
    for axis, title in zip(axes, ["whole run", "second half"]):
        axis.set(xlabel="tokens (all units)", ylabel="held-out eval loss (median over seeds)", title=title)
    axes[0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_report(doc: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / REPORT).write_text(json.dumps(doc, indent=1) + "\n")
    (out / "horizon.md").write_text(markdown(doc))
    plot(doc, out / "horizon.png")
