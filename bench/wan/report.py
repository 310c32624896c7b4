"""WAN comparison outputs: ``results.json``, ``results.md`` and ``results.png``, from each method's
:class:`MethodResult`, its units' metrics logs (``<out>/<method>/unit<i>/metrics.jsonl``) and its link samples
(``<out>/<method>/links.jsonl``).

Per method: time to a target eval loss and the speed-up over sync-dp, compute utilisation per unit, bytes per inner
step per unit (what crossed its emulated link), peak link rate, and eval loss at equal tokens; the issue's targets
are judged for every ``ours*`` method. Every number is computed by a pure function of the logs; a quantity that a
run did not produce (no eval, no step, no sample) is ``None`` (``n/a`` in the table), never an error.
"""

from __future__ import annotations

import json
import shlex
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench.chaos.links import bytes_between, peak_rate_bps, read_samples  # noqa: E402
from bench.chaos.report import (  # noqa: E402
    command_note,
    equal_tokens,
    loss_at_tokens,
    method_summary,
    plot_eval_curves,
)
from bench.chaos.results import MethodResult  # noqa: E402
from bench.curves import first_reach  # noqa: E402
from bench.events import LinkBytes, RankStep  # noqa: E402
from p2p_diloco.unit.events import InnerStep, Stop, read_events  # noqa: E402

BASELINE = "sync-dp"
# sync-dp on 127.0.0.1 without a rate limit: the same math as sync-dp, so the same eval loss per token, reached at token
# counts that sync-dp cannot reach on the slow links in the budget. It is the reference for the loss at equal tokens
# (when it ran) and takes no part in the timings.
QUALITY_REFERENCE = "dp-reference"
LINKS_FILE = "links.jsonl"
PEAK_WINDOW_S = 1.0
LADDER_FRACTIONS = (0.25, 0.5, 0.75, 1.0)  # of sync-dp's drop in eval loss: the targets of the ladder


@dataclass(frozen=True)
class StepSpan:
    """A unit's inner steps: how many it took, and the compute seconds of the steps after its first logged step up
    to its last one, with the wall seconds between those two log lines."""

    inner_steps: int
    compute_s: float
    window_s: float

    @property
    def utilisation(self) -> float | None:
        """Compute over wall time in the window (None for a window of zero length)."""
        return self.compute_s / self.window_s if self.window_s > 0 else None


def step_span(metrics: Path) -> StepSpan | None:
    """The :class:`StepSpan` of one unit's metrics log (a gang rank's or a swarm unit's); None when it logged no step.

    A gang rank logs every ``step`` (``compute_s`` excludes the all-reduce), so the window's compute is exact. A swarm
    unit logs an ``inner_step`` every 10 steps; see :func:`unit_span`."""
    steps = sorted(read_events(metrics, RankStep), key=lambda event: event.time)
    if steps:
        return StepSpan(len(steps), sum(event.compute_s for event in steps[1:]), steps[-1].time - steps[0].time)
    return unit_span(read_events(metrics, InnerStep), read_events(metrics, Stop))


def unit_span(marks: Sequence[InnerStep], stops: Sequence[Stop]) -> StepSpan | None:
    """A swarm unit's span from its ``inner_step`` marks (every 10 steps): the window's compute is its mean step compute
    (the last ``stop`` event's ``compute_s`` / ``inner_step``; without a stop, the mean of the marks' ``seconds``) times
    the steps between its first and last mark, and its step count is the stop's (else the last mark's step); None
    without marks."""
    marks = sorted(marks, key=lambda event: event.time)
    stops = [event for event in stops if event.inner_step]
    if not marks:
        return None
    if stops:
        inner_steps = stops[-1].inner_step
        mean_compute_s = stops[-1].compute_s / inner_steps
    else:
        inner_steps = marks[-1].step
        mean_compute_s = statistics.fmean(event.seconds for event in marks)
    window_steps = marks[-1].step - marks[0].step
    return StepSpan(inner_steps, mean_compute_s * window_steps, marks[-1].time - marks[0].time)


@dataclass(frozen=True)
class LinkUse:
    """What crossed one node's link over the whole sampled span, and its highest rate either way; ``exit_bytes``:
    both ways, after the node's last logged inner step (its exit: final and settle rounds, last records)."""

    tx_bytes: int
    rx_bytes: int
    peak_bps: float | None  # None: the samples span less than one window
    exit_bytes: int | None = None  # None: no inner step logged


def link_use(
    samples: Sequence[LinkBytes], node: str, window_s: float = PEAK_WINDOW_S, last_step_at: float | None = None
) -> LinkUse | None:
    """``node``'s :class:`LinkUse` from link samples (exit bytes counted from ``last_step_at``, unix seconds, when
    given); None when it has no sample."""
    times = [sample.time for sample in samples if sample.node == node]
    if not times:
        return None
    tx_bytes, rx_bytes = bytes_between(samples, node, min(times), max(times))
    exit_bytes = None
    if last_step_at is not None:
        exit_bytes = sum(bytes_between(samples, node, min(max(times), max(min(times), last_step_at)), max(times)))
    try:
        peak: float | None = peak_rate_bps(samples, node, window_s)
    except ValueError:
        peak = None
    return LinkUse(tx_bytes, rx_bytes, peak, exit_bytes)


def last_step_at(metrics: Path) -> float | None:
    """When a unit or rank logged its last step (None: none logged)."""
    times = [event.time for event in [*read_events(metrics, RankStep), *read_events(metrics, InnerStep)]]
    return max(times, default=None)


@dataclass(frozen=True)
class UnitWan:
    """One unit slot of a method: its steps and its link (None: not logged or not sampled)."""

    unit: int
    span: StepSpan | None
    link: LinkUse | None

    def per_step(self, direction: Literal["tx", "rx"]) -> float | None:
        """``direction`` ("tx" or "rx") bytes of the unit's link per inner step of the unit (None: not measured)."""
        if self.span is None or self.link is None or self.span.inner_steps == 0:
            return None
        return getattr(self.link, f"{direction}_bytes") / self.span.inner_steps

    def to_dict(self) -> dict[str, Any]:
        return {
            "unit": self.unit,
            **(asdict(self.span) if self.span else dict.fromkeys(field.name for field in fields(StepSpan))),
            "utilisation": self.span.utilisation if self.span else None,
            **(asdict(self.link) if self.link else dict.fromkeys(field.name for field in fields(LinkUse))),
            "tx_bytes_per_step": self.per_step("tx"),
            "rx_bytes_per_step": self.per_step("rx"),
        }


def read_units(run_dir: Path, units: int) -> list[UnitWan]:
    """Every unit slot of a method's run folder (a missing log or sample file gives None parts)."""
    samples = read_samples(run_dir / LINKS_FILE)
    logs = [run_dir / f"unit{unit}" / "metrics.jsonl" for unit in range(units)]
    return [
        UnitWan(unit, step_span(log), link_use(samples, f"unit{unit}", last_step_at=last_step_at(log)))
        for unit, log in enumerate(logs)
    ]


# ------------------------------------------------------------------------------------------------ comparisons
def on_the_links(results: Sequence[MethodResult]) -> list[MethodResult]:
    """The methods that trained over the emulated links (all but the quality reference)."""
    return [result for result in results if result.method != QUALITY_REFERENCE]


def default_target_loss(results: Sequence[MethodResult]) -> float | None:
    """The highest of the best eval losses of the methods on the links, which every one of them with an eval reached
    (None: no evals)."""
    best = [min(point.eval_loss for point in result.evals) for result in on_the_links(results) if result.evals]
    return max(best) if best else None


def comparison_tokens(results: Sequence[MethodResult]) -> int | None:
    """Where eval losses are compared: the largest token count every method reached, leaving out sync-dp when the
    quality reference (its same math without rate limit) ran."""
    has_reference = any(result.method == QUALITY_REFERENCE for result in results)
    return equal_tokens([result for result in results if not (has_reference and result.method == BASELINE)])


def time_to_target(result: MethodResult, target_loss: float, since_first_eval: bool = True) -> float | None:
    """Wall seconds to ``result``'s first eval at or below ``target_loss`` (None: never reached), counted from its first
    eval (the initial weights', written once its processes are up: training time) or, with ``since_first_eval``
    False, from the launch of its processes (start-up included)."""
    points = sorted(result.evals, key=lambda point: point.wall_s)
    reached = next((point.wall_s for point in points if point.eval_loss <= target_loss), None)
    if reached is None or not since_first_eval:
        return reached
    return reached - points[0].wall_s


def deeper_target_loss(results: Sequence[MethodResult]) -> float | None:
    """A loss deeper into training than sync-dp reaches on the links in the budget: the highest of the best eval losses
    of the other methods on the links (None without them, or when the quality reference never reached it)."""
    others = [result for result in on_the_links(results) if result.method != BASELINE]
    target = default_target_loss(others) if others else None
    reference = next((result for result in results if result.method == QUALITY_REFERENCE), None)
    if target is None or reference is None or tokens_to_target(reference, target) is None:
        return None
    return target


def tokens_to_target(result: MethodResult, target_loss: float) -> int | None:
    """Training tokens of ``result``'s first eval (in token order) at or below ``target_loss`` (None: never)."""
    points = sorted(result.evals, key=lambda point: point.tokens)
    return next((point.tokens for point in points if point.eval_loss <= target_loss), None)


def token_rate(result: MethodResult) -> float | None:
    """Training tokens per second that reached ``result``'s consensus model between its first and last eval (None:
    fewer than two evals apart in time)."""
    points = sorted(result.evals, key=lambda point: point.wall_s)
    if len(points) < 2 or points[-1].wall_s <= points[0].wall_s:
        return None
    return (points[-1].tokens - points[0].tokens) / (points[-1].wall_s - points[0].wall_s)


def projected_time_to_target(baseline: MethodResult, reference: MethodResult, target_loss: float) -> float | None:
    """sync-dp's time to a target it did not reach on the links in the budget: the tokens the quality reference (the
    same math) needed to reach it, at the token rate sync-dp measured on the links (constant: every step waits for
    the same all-reduce). None when either is unknown."""
    tokens, rate = tokens_to_target(reference, target_loss), token_rate(baseline)
    return tokens / rate if tokens is not None and rate else None


def crossing(result: MethodResult, target_loss: float, axis: Literal["wall_s", "tokens"]) -> float | None:
    """Where ``result``'s eval curve (in time order) first reaches ``target_loss``: wall seconds since its first eval,
    or training tokens, interpolated between evals (:func:`bench.curves.first_reach`; sync-dp's evals on slow links
    are minutes apart). None: never reached."""
    points = sorted(result.evals, key=lambda point: point.wall_s)
    if axis == "wall_s":
        origin = points[0].wall_s if points else 0.0
        return _shifted(first_reach([(point.wall_s, point.eval_loss) for point in points], target_loss), -origin)
    if any(later.tokens < earlier.tokens for earlier, later in zip(points, points[1:])):
        raise ValueError(f"{result.method}: tokens in its consensus model went down between evals")
    return first_reach([(point.tokens, point.eval_loss) for point in points], target_loss)


def _shifted(value: float | None, by: float) -> float | None:
    return None if value is None else value + by


def target_ladder(results: Sequence[MethodResult]) -> list[float]:
    """Eval losses sync-dp reached on the links: from its first eval's loss toward its best by LADDER_FRACTIONS of the
    drop, so that its time to every one is measured, not projected ([] without sync-dp evals or a drop)."""
    baseline = next((result for result in results if result.method == BASELINE and result.evals), None)
    if baseline is None:
        return []
    first = min(baseline.evals, key=lambda point: point.wall_s).eval_loss
    best = min(point.eval_loss for point in baseline.evals)
    return [first - fraction * (first - best) for fraction in LADDER_FRACTIONS] if best < first else []


def ladder_rows(results: Sequence[MethodResult], targets: Sequence[float]) -> list[dict[str, Any]]:
    """For every target and every method on the links: its time and tokens to the target (:func:`crossing`), the
    speed-up (sync-dp's time over its own) and its tokens over data-parallel's (the quality reference's where it ran,
    else sync-dp's: the same math), the token penalty that the speed-up pays; None where unknown."""
    by_method = {result.method: result for result in results}
    baseline = by_method.get(BASELINE)
    data_parallel = by_method.get(QUALITY_REFERENCE, baseline)
    rows = []
    for target in targets:
        base_time = crossing(baseline, target, "wall_s") if baseline else None
        dp_tokens = crossing(data_parallel, target, "tokens") if data_parallel else None
        for result in on_the_links(results):
            time_s, tokens = crossing(result, target, "wall_s"), crossing(result, target, "tokens")
            rows.append({
                "target_loss": target, "method": result.method, "time_s": time_s, "tokens": tokens,
                "speedup_vs_sync_dp": _ratio(base_time, time_s if time_s and time_s > 0 else None),
                "tokens_vs_data_parallel": _ratio(tokens, dp_tokens),
            })  # fmt: skip
    return rows


def ladder_lines(rows: Sequence[Mapping[str, Any]]) -> str:
    """The markdown section of the target ladder ("" without one)."""
    if not rows:
        return ""
    lines = [
        "Time to several targets, every one of them reached by sync-dp on the links (its first eval's loss minus "
        f"{', '.join(f'{f:.0%}' for f in LADDER_FRACTIONS)} of its drop to its best), interpolated between evals:",
        "",
        "| target eval loss | method | time to it (s) | speed-up vs sync-dp | tokens to it | tokens vs data-parallel |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['target_loss']:.4f} | {row['method']} | {_cell(row['time_s'], ',.1f')} "
            f"| {_cell(row['speedup_vs_sync_dp'], '.1f', suffix='×')} | {_cell(row['tokens'], ',.0f')} "
            f"| {_cell(row['tokens_vs_data_parallel'], '.2f', suffix='×')} |"
        )
    return "\n".join(lines)


def eval_bracket(result: MethodResult, tokens: int) -> tuple[int, int] | None:
    """Token counts of the two evals that :func:`loss_at_tokens` interpolates between at ``tokens`` (the same one
    twice at an eval or beyond the curve's ends); None without evals."""
    counts = sorted({point.tokens for point in result.evals})
    if not counts:
        return None
    below = [count for count in counts if count <= tokens]
    above = [count for count in counts if count >= tokens]
    return (below[-1] if below else counts[0]), (above[0] if above else counts[-1])


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def _max(values: Sequence[float | None]) -> float | None:
    known = [value for value in values if value is not None]
    return max(known) if known else None


def method_row(
    result: MethodResult, units: Sequence[UnitWan], target_loss: float | None, tokens: int | None
) -> dict[str, Any]:
    """One method's numbers (without the comparisons to sync-dp, see :func:`compare`). Bytes per inner step and peak
    rate are the highest over the units; utilisation is given as the minimum and median over the units."""
    utilisations = [unit.span.utilisation for unit in units if unit.span and unit.span.utilisation is not None]
    timed = target_loss if result.method != QUALITY_REFERENCE else None
    return {
        "method": result.method,
        "time_to_target_s": time_to_target(result, timed) if timed is not None else None,
        "time_to_target_from_launch_s": time_to_target(result, timed, since_first_eval=False)
        if timed is not None
        else None,
        "utilisation_min": min(utilisations) if utilisations else None,
        "utilisation_median": statistics.median(utilisations) if utilisations else None,
        "inner_steps": sum(unit.span.inner_steps for unit in units if unit.span),
        "tx_bytes_per_step": _max([unit.per_step("tx") for unit in units]),
        "rx_bytes_per_step": _max([unit.per_step("rx") for unit in units]),
        "peak_bps": _max([unit.link.peak_bps if unit.link else None for unit in units]),
        "exit_share": exit_share(units),
        "eval_loss_at_equal_tokens": loss_at_tokens(result, tokens) if tokens is not None else None,
        "equal_tokens_between_evals": eval_bracket(result, tokens) if tokens is not None else None,
        "final_eval_loss": result.final_eval_loss,
        "units": [unit.to_dict() for unit in units],
        "summary": method_summary(result, tokens),
    }


def exit_share(units: Sequence[UnitWan]) -> float | None:
    """The share of all the units' link bytes (both ways) that crossed after their last inner step (None: not
    measured for every unit)."""
    links = [unit.link for unit in units]
    if not links or any(link is None or link.exit_bytes is None for link in links):
        return None
    whole = sum(link.tx_bytes + link.rx_bytes for link in links if link is not None)
    return sum(link.exit_bytes or 0 for link in links if link is not None) / whole if whole else None


def compare(rows: Sequence[dict[str, Any]]) -> None:
    """Add to every row its speed-up to the target over sync-dp, sync-dp's bytes per inner step over its own, and
    its eval loss at equal tokens relative to data-parallel's (the quality reference's when it ran, else sync-dp's);
    None without the reference rows or the numbers."""
    baseline = next((row for row in rows if row["method"] == BASELINE), {})
    quality = next((row for row in rows if row["method"] == QUALITY_REFERENCE), baseline)
    for row in rows:
        time_s = row["time_to_target_s"]
        row["speedup_vs_sync_dp"] = _ratio(baseline.get("time_to_target_s"), time_s if time_s and time_s > 0 else None)
        row["bytes_ratio_vs_sync_dp"] = _ratio(baseline.get("tx_bytes_per_step"), row["tx_bytes_per_step"])
        loss_ratio = _ratio(row["eval_loss_at_equal_tokens"], quality.get("eval_loss_at_equal_tokens"))
        row["loss_vs_sync_dp"] = loss_ratio - 1 if loss_ratio is not None else None


def add_deeper_target(rows: Sequence[dict[str, Any]], results: Sequence[MethodResult], target: float | None) -> None:
    """Add to every row its time to the deeper target (:func:`deeper_target_loss`), measured, or for sync-dp projected
    when it did not reach it (``deeper_target_projected``), and the speed-up over sync-dp's; None where unknown."""
    by_method = {result.method: result for result in results}
    baseline, reference = by_method.get(BASELINE), by_method.get(QUALITY_REFERENCE)
    for row in rows:
        result = by_method[row["method"]]
        timed = target if result.method != QUALITY_REFERENCE else None
        row["time_to_deeper_target_s"] = time_to_target(result, timed) if timed is not None else None
        row["deeper_target_projected"] = False
        missed = timed is not None and row["time_to_deeper_target_s"] is None
        if missed and timed is not None and result is baseline and reference is not None:
            row["time_to_deeper_target_s"] = projected_time_to_target(result, reference, timed)
            row["deeper_target_projected"] = row["time_to_deeper_target_s"] is not None
    base_time = next((row["time_to_deeper_target_s"] for row in rows if row["method"] == BASELINE), None)
    for row in rows:
        time_s = row["time_to_deeper_target_s"]
        row["speedup_deeper_vs_sync_dp"] = _ratio(base_time, time_s if time_s and time_s > 0 else None)


def deeper_target_lines(rows: Sequence[Mapping[str, Any]], target: float | None) -> str:
    """The markdown section of the deeper target ("" without one)."""
    if target is None:
        return ""
    lines = [
        f"Deeper target: eval loss {target:.4f} (the highest best loss of the methods on the links other than "
        "sync-dp). Where sync-dp did not get there within the budget on the links, its time is projected: the tokens "
        "dp-reference (the same math) needed to reach it, at the token rate sync-dp measured on the links.",
        "",
    ]
    for row in rows:
        if row["method"] == QUALITY_REFERENCE:
            continue
        shown = _cell(row["time_to_deeper_target_s"], ",.1f", suffix=" s")
        projected = " (projected)" if row["deeper_target_projected"] else ""
        speedup = _cell(row["speedup_deeper_vs_sync_dp"], ".1f", suffix="×")
        lines.append(f"- {row['method']}: {shown}{projected}, speed-up vs sync-dp {speedup}")
    return "\n".join(lines)


@dataclass(frozen=True)
class Target:
    """One of the issue's targets for our methods: ``key`` of a row must be at least (or at most) ``threshold``."""

    name: str
    key: str
    threshold: float
    at_least: bool
    value_format: str
    suffix: str
    wanted: str

    def judge(self, row: Mapping[str, Any]) -> dict[str, Any]:
        """``{"method", "target", "value", "met", "line"}``; met is None when the value was not measured."""
        value = row.get(self.key)
        met = None if value is None else (value >= self.threshold if self.at_least else value <= self.threshold)
        shown = _cell(value, self.value_format, suffix=self.suffix)
        verdict = {None: "not measured", True: "met", False: "NOT met"}[met]
        line = f"{row['method']}: {self.name} {shown} (target: {self.wanted}): **{verdict}**"
        return {"method": row["method"], "target": self.name, "value": value, "met": met, "line": line}


TARGETS = (
    Target("speed-up over sync-dp to the target eval loss", "speedup_vs_sync_dp", 20.0, True, ".1f", "×", "≥ 20×"),
    Target(
        "speed-up over sync-dp to the deeper target (sync-dp projected)",
        "speedup_deeper_vs_sync_dp",
        20.0,
        True,
        ".1f",
        "×",
        "≥ 20×",
    ),  # fmt: skip
    Target("compute utilisation (lowest unit)", "utilisation_min", 0.95, True, ".1%", "", "≥ 95%"),
    Target("sync-dp bytes per inner step / ours", "bytes_ratio_vs_sync_dp", 1000.0, True, ",.0f", "×", "≥ 1000×"),
    Target("eval loss at equal tokens vs data-parallel", "loss_vs_sync_dp", 0.015, False, "+.2%", "", "at most +1.5%"),
)


def judge_targets(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Every target of :data:`TARGETS` for every row whose method starts with ``ours``."""
    return [target.judge(row) for row in rows if row["method"].startswith("ours") for target in TARGETS]


# ------------------------------------------------------------------------------------------------ outputs
DEFINITIONS = f"""\
- Time to target: wall seconds from the method's first held-out eval of the consensus model (the initial weights',
  written once its processes are up, so start-up is left out for every method) to its first eval at or below the
  target loss; the JSON also has the time from the launch of its processes. The default target is the highest of
  the best eval losses of the methods on the links, so every one of them reaches it. Speed-up: sync-dp's time over
  the method's. dp-reference is not timed: it did not train over the links.
- Compute utilisation of a unit: inner-step compute seconds / wall seconds between its first and last logged inner
  step. sync-*: per-step compute_s, which excludes the all-reduce. ours: inner steps are logged every 10 steps, so the
  compute between the first and last logged step is the unit's mean step compute (stop event) times the steps between
  them. Evals, round bookkeeping and waiting on the network or the CPU count as not computing.
- Bytes per inner step: what crossed the unit's emulated link (interface counters of its namespace, frames with
  headers, sampled every 0.5 s) over the method's whole run, divided by the unit's inner steps; the highest unit is
  shown. tx is what it sent, rx what it received.
- Peak link rate: the highest rate either way over {PEAK_WINDOW_S:.0f} s windows, highest unit.
- Bytes after the last inner step: what crossed every unit's link, both ways, after its last logged inner step (the
  exit: final and settle rounds, last records; ours logs every 10th step, so up to 10 steps of training count too),
  over all its link bytes.
- Eval loss at equal tokens: linear interpolation of each method's eval curve at the largest token count every
  method's consensus model reached (tokens whose update is in the consensus model, all units together), compared
  with data-parallel's. When dp-reference ran (sync-dp's math on 127.0.0.1 without rate limit: the same loss per
  token), it is the data-parallel reference and sync-dp, which reaches far fewer tokens on the links, is left out of
  the token count.
- Targets are judged on the numbers above: the lowest unit's utilisation, the highest unit's bytes; the loss target
  is met by any eval loss at most 1.5% above sync-dp's (a lower loss meets it).
"""


def _cell(value: float | None, fmt: str, scale: float = 1.0, suffix: str = "") -> str:
    return "n/a" if value is None else format(value * scale, fmt) + suffix


def markdown_table(rows: Sequence[Mapping[str, Any]], target_loss: float | None, tokens: int | None) -> str:
    target = _cell(target_loss, ".4f")
    lines = [
        f"| method | inner steps (all units) | time to loss {target} (s) | speed-up vs sync-dp "
        f"| compute utilisation min / median | tx bytes per inner step | rx bytes per inner step "
        f"| sync-dp bytes / method bytes | peak link rate (Mbit/s) | eval loss at {tokens or 'n/a'} tokens "
        f"| vs data-parallel | final eval loss | bytes after the last inner step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['method']} | {row['inner_steps']:,} | {_cell(row['time_to_target_s'], '.1f')} "
            f"| {_cell(row['speedup_vs_sync_dp'], '.2f', suffix='×')} "
            f"| {_cell(row['utilisation_min'], '.1%')} / {_cell(row['utilisation_median'], '.1%')} "
            f"| {_cell(row['tx_bytes_per_step'], ',.0f')} | {_cell(row['rx_bytes_per_step'], ',.0f')} "
            f"| {_cell(row['bytes_ratio_vs_sync_dp'], ',.1f', suffix='×')} | {_cell(row['peak_bps'], '.2f', 1e-6)} "
            f"| {_cell(row['eval_loss_at_equal_tokens'], '.4f')} | {_cell(row['loss_vs_sync_dp'], '+.2%')} "
            f"| {_cell(row['final_eval_loss'], '.4f')} | {_cell(row.get('exit_share'), '.1%')} |"
        )
    return "\n".join(lines)


def _interpolation_notes(rows: Sequence[Mapping[str, Any]], tokens: int | None) -> list[str]:
    """A line for each method whose eval loss at equal tokens lies between two of its evals (not at one)."""
    notes = []
    for row in rows:
        bracket = row["equal_tokens_between_evals"]
        if tokens is not None and bracket is not None and bracket[0] != bracket[1]:
            notes.append(
                f"- {row['method']}: eval loss at {tokens:,} tokens interpolated between its evals at "
                f"{bracket[0]:,} and {bracket[1]:,} tokens"
            )
    return notes


def plot(
    results: Sequence[MethodResult], rows: Sequence[Mapping[str, Any]], target_loss: float | None, path: Path
) -> None:
    """Eval loss against wall time (log x) and against tokens, and bytes per inner step per method (log y)."""
    figure, (by_time, by_tokens, by_bytes) = plt.subplots(1, 3, figsize=(17, 4.8))
    plot_eval_curves(by_time, list(results), "wall_s")
    by_time.set_xscale("log")
    if target_loss is not None:
        by_time.axhline(target_loss, color="grey", linestyle="--", linewidth=1, label="target")
        by_time.legend()
    plot_eval_curves(by_tokens, list(results), "tokens")
    measured = [(row["method"], row["tx_bytes_per_step"]) for row in rows if row["tx_bytes_per_step"]]
    if measured:
        by_bytes.bar(*zip(*measured))
        by_bytes.set_yscale("log")
    by_bytes.set_ylabel("bytes sent per inner step (highest unit)")
    by_bytes.tick_params(axis="x", rotation=30)
    by_bytes.grid(alpha=0.3, axis="y")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_report(
    out_dir: Path,
    results: Sequence[MethodResult],
    units: int,
    target_loss: float | None,
    command: list[str],
    header: Mapping[str, Any],
) -> str:
    """Write results.json, results.md and results.png into ``out_dir`` (``target_loss`` None: the default target);
    returns the markdown. ``header`` (environment, config, ...) goes into the JSON as is, its "environment" into the
    markdown too."""
    target = target_loss if target_loss is not None else default_target_loss(results)
    tokens = comparison_tokens(results)
    rows = [method_row(result, read_units(out_dir / result.method, units), target, tokens) for result in results]
    compare(rows)
    deeper = deeper_target_loss(results)
    add_deeper_target(rows, results, deeper)
    judgements = judge_targets(rows)
    ladder = ladder_rows(results, target_ladder(results))
    (out_dir / "results.json").write_text(
        json.dumps(
            {
                "command": shlex.join(command),
                **header,
                "target_loss": target,
                "target_loss_default": target_loss is None,
                "equal_tokens": tokens,
                "deeper_target_loss": deeper,
                "targets": judgements,
                "ladder": ladder,
                "methods": rows,
            },
            indent=2,
        )
        + "\n"
    )
    notes = _interpolation_notes(rows, tokens) + [
        f"- {result.method}: {note}" for result in results for note in result.notes
    ]
    environment = ", ".join(f"{key} {value}" for key, value in header.get("environment", {}).items())
    sections = [
        markdown_table(rows, target, tokens),
        deeper_target_lines(rows, deeper),
        ladder_lines(ladder),
        "Targets of the issue:\n\n" + "\n".join(f"- {j['line']}" for j in judgements) if judgements else "",
        "Definitions:\n\n" + DEFINITIONS.rstrip(),
        "Notes:\n\n" + "\n".join(notes) if notes else "",
        f"Environment: {environment}.",
        command_note(command),
    ]
    markdown = "\n\n".join(section for section in sections if section) + "\n"
    (out_dir / "results.md").write_text(markdown)
    plot(results, rows, target, out_dir / "results.png")
    return markdown
