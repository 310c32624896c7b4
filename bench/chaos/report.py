"""Chaos comparison outputs: ``results.json``, ``results.md`` (one row per method) and ``results.png`` (eval loss
against wall time, and goodput per method)."""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402

from bench.chaos.results import MethodResult  # noqa: E402
from bench.curves import loss_at as curve_loss_at  # noqa: E402


def equal_tokens(results: list[MethodResult]) -> int | None:
    """The largest token count that every method's consensus model reached (None if one has no eval)."""
    reached = [max((point.tokens for point in result.evals), default=None) for result in results]
    counts = [tokens for tokens in reached if tokens is not None]
    return None if not results or len(counts) < len(reached) else min(counts)


def loss_at_tokens(result: MethodResult, tokens: int) -> float | None:
    """Eval loss of ``result``'s consensus model at ``tokens`` training tokens, linearly interpolated between its
    evals (None without evals)."""
    points = [(point.tokens, point.eval_loss) for point in result.evals]
    return curve_loss_at(points, tokens) if points else None


def command_note(command: list[str]) -> str:
    """How to reproduce a run, for a markdown report (arguments quoted for a shell where needed)."""
    return f"Reproduce with:\n\n```\n{shlex.join(command)}\n```"


def method_summary(result: MethodResult, tokens: int | None) -> dict[str, Any]:
    return {
        "method": result.method,
        "goodput": result.goodput,
        "unit_goodput": [result.unit_goodput(unit.unit) for unit in result.units],
        "compute_s": sum(unit.compute_s for unit in result.units),
        "useful_compute_s": sum(unit.useful_compute_s for unit in result.units),
        "tokens": sum(unit.tokens for unit in result.units),
        "useful_tokens": sum(unit.useful_tokens for unit in result.units),
        "final_eval_loss": result.final_eval_loss,
        "eval_loss_at_equal_tokens": loss_at_tokens(result, tokens) if tokens is not None else None,
        "notes": result.notes,
        "units": [asdict(unit) for unit in result.units],
        "evals": [asdict(point) for point in result.evals],
    }


def _cell(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def markdown_table(summaries: list[dict[str, Any]], tokens: int | None) -> str:
    lines = [
        f"| method | goodput | goodput per unit | tokens processed | tokens in the model | final eval loss "
        f"| eval loss at {tokens if tokens is not None else 'n/a'} tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in summaries:
        per_unit = " / ".join(f"{value:.0%}" for value in row["unit_goodput"])
        lines.append(
            f"| {row['method']} | {row['goodput']:.1%} | {per_unit} | {row['tokens']:,} | {row['useful_tokens']:,} "
            f"| {_cell(row['final_eval_loss'], '.4f')} | {_cell(row['eval_loss_at_equal_tokens'], '.4f')} |"
        )
    return "\n".join(lines)


def plot_eval_curves(axes: Axes, results: list[MethodResult], x: Literal["wall_s", "tokens"] = "wall_s") -> None:
    """One eval-loss line per method (a method without evals has none) against wall time or training tokens."""
    for result in results:
        points = sorted((getattr(point, x), point.eval_loss) for point in result.evals)
        if points:
            axes.plot(*zip(*points), marker=".", linewidth=1, label=result.method)
    axes.set_xlabel("wall time since start (s)" if x == "wall_s" else "training tokens in the consensus model")
    axes.set_ylabel("held-out eval loss of the consensus model")
    axes.legend()
    axes.grid(alpha=0.3)


def plot(results: list[MethodResult], path: Path) -> None:
    figure, (losses, goodputs) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    plot_eval_curves(losses, results)
    goodputs.bar([result.method for result in results], [100 * result.goodput for result in results])
    goodputs.set_ylabel("goodput (%)")
    goodputs.set_ylim(0, 100)
    goodputs.tick_params(axis="x", rotation=30)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_report(out_dir: Path, results: list[MethodResult], header: dict[str, Any], notes_md: str = "") -> str:
    """Write results.json, results.md and results.png into ``out_dir``; returns the markdown."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokens = equal_tokens(results)
    summaries = [method_summary(result, tokens) for result in results]
    (out_dir / "results.json").write_text(
        json.dumps({**header, "equal_tokens": tokens, "methods": summaries}, indent=2) + "\n"
    )
    markdown = markdown_table(summaries, tokens) + ("\n\n" + notes_md if notes_md else "") + "\n"
    (out_dir / "results.md").write_text(markdown)
    plot(results, out_dir / "results.png")
    return markdown
