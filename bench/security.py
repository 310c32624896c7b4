"""The security benchmark: one modified unit (bench/red_team.py) among honest ones, against the honest units alone.

Every run starts a bootstrap node and ``honest`` units of the tiny preset with fixed identities (the same peer ids,
so the same data shards and seeds, in every run) that each train ``max_steps`` inner steps and leave; in every run
but ``honest-only`` one more unit joins with them: a red-team variant, or an unmodified unit that is not a member of
the (then private) run. A run's figures: the honest units' final eval losses (their exported consensus model), the
largest relative distance between their final φ, and how often their logs name a defence.
"""

from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.red_team import admitted_flags, red_team_cli
from bench.scale import _final_phi
from bench.swarm import Swarm
from p2p_diloco.consensus import pairwise_distances
from p2p_diloco.network.dht import ensure_identity
from p2p_diloco.ops.launcher import CLI
from p2p_diloco.unit.events import (
    ConsensusRound,
    Eval,
    InnerStep,
    Join,
    OuterRound,
    OuterRoundFailed,
    Stop,
    read_events,
)

RUN_ID = "security"
UNIT_FLAGS = ("--seq-len", "64", "--batch-size", "4", "--inner-steps", "10", "--join-timeout-s", "60",
              "--eval-every-rounds", "5")  # fmt: skip
DIRECTION_LOG = ("--log-level", "DEBUG")  # every member's step agreement is a DEBUG line (gated.py)
AGREEMENT = re.compile(r"member (\S+)(?: offended)?: .*its step's agreement with this unit's ([+-]\d+\.\d+)")
NON_MEMBER = "non-member"
HONEST_ONLY = "honest-only"
VARIANTS = (HONEST_ONLY, "payload-nan", "payload-x1000", "payload-noise", "step-flip",
            "pseudo-gradient-flip-x3", "weight-x1000", "gather-garbage", "gather-far-ahead", "reducer-x1000",
            "state-far-ahead", "donor-flood", "record-forgery", NON_MEMBER)  # fmt: skip
DEFENCES = {  # what a defence's log line says
    "not believed": "not believed",
    "offended": "offended:",
    "refused": "refused ",
    "clipped or capped": "parts dropped",
    "rejected": "moves φ",
    "averages replaced": "averages replaced",
}
COST_FROM_STEP = 50  # start-up excluded from the step times
EXIT_GRACE_S = 120.0


@dataclass(frozen=True)
class SecuritySpec:
    variant: str
    honest: int = 3
    max_steps: int = 200


def run_variant(spec: SecuritySpec, root: Path, identities: Path) -> dict[str, Any]:
    """Run one variant under ``root`` (identities and the run key are kept in ``identities``) and measure it."""
    private = spec.variant == NON_MEMBER
    swarm = Swarm(root, run_id=RUN_ID, unit_flags=(*UNIT_FLAGS, "--max-steps", str(spec.max_steps), *DIRECTION_LOG))
    honest = [f"unit{index}" for index in range(spec.honest)]
    started = time.time()
    try:
        maddr = swarm.bootstrap("bootstrap")
        run_key = ensure_identity(identities / "run.key")
        for name in honest:
            if private:
                flags = admitted_flags(identities, name, RUN_ID, run_key)
            else:
                flags = ("--identity-path", str(ensure_identity(identities / f"{name}.key")))
            swarm.unit(name, [maddr], *flags)
        if private:
            swarm.unit("red", [maddr])  # the package's own CLI, without an admission
        elif spec.variant != HONEST_ONLY:
            swarm.unit("red", [maddr], cli=red_team_cli(spec.variant))
        swarm.wait_for(lambda: all(not swarm.running(name) for name in honest), timeout_s=1800,
                       what="the honest units to finish their steps")  # fmt: skip
        exits = {name: swarm.processes[name].wait() for name in honest}  # each has exited
    finally:
        swarm.close(grace_s=EXIT_GRACE_S)
    return measure(spec, root, honest, exits, time.time() - started)


def measure(spec: SecuritySpec, root: Path, honest: list[str], exits: dict[str, int], seconds: float) -> dict:
    finals = {}
    for name in honest:
        evals = [event for event in read_events(root / name / "metrics.jsonl", Eval) if event.reason == "final"]
        finals[name] = evals[-1].eval_loss if evals and evals[-1].eval_loss is not None else None
    vectors = [vector for vector in (_final_phi(root / name) for name in honest) if vector is not None]
    lines = [line for name in honest for line in (root / name / "stdout.log").read_text().splitlines()]
    logs = "\n".join(line for line in lines if " DEBUG " not in line)
    rounds = [event for name in honest for event in read_events(root / name / "metrics.jsonl", OuterRound)]
    merged = [event for event in rounds if event.group_size > 1]
    failed = [event for name in honest for event in read_events(root / name / "metrics.jsonl", OuterRoundFailed)]
    losses = [loss for loss in finals.values() if loss is not None]
    return {
        "variant": spec.variant,
        "honest_units": spec.honest,
        "max_steps": spec.max_steps,
        "seconds": seconds,
        "exit_codes": exits,
        "final_eval": finals,
        "final_eval_mean": statistics.fmean(losses) if losses else None,
        "final_eval_spread": max(losses) - min(losses) if losses else None,
        "final_max_distance": max(pairwise_distances(vectors), default=0.0) if len(vectors) > 1 else None,
        "rounds": len(rounds),
        "mean_group": statistics.fmean(event.group_size for event in merged) if merged else None,
        "rounds_failed": len(failed),
        "defences": {name: logs.count(text) for name, text in DEFENCES.items()},
        "directions": directions(lines, _red_peer_id(root)),
    }


def _red_peer_id(root: Path) -> str | None:
    joins = read_events(root / "red" / "metrics.jsonl", Join) if (root / "red" / "metrics.jsonl").exists() else []
    return joins[-1].peer_id if joins else None


def directions(lines: list[str], red: str | None) -> dict[str, Any]:
    """The honest units' judgement of directions: every member's step agreement with theirs, by honest and red
    members, and how many of their log lines said a member's steps pull against theirs."""
    agreements: dict[str, list[float]] = {"honest": [], "red": []}
    pulling = {"honest": 0, "red": 0}
    for line in lines:
        found = AGREEMENT.search(line)
        if found:
            who = "red" if found.group(1) == red else "honest"
            agreements[who].append(float(found.group(2)))
            pulling[who] += "pull against" in line
    return {"agreements": agreements, "pulling": pulling}


def baseline_eval(results: list[dict[str, Any]]) -> float | None:
    """The reference: the median over the honest-only runs of their honest units' mean final eval."""
    means = [r["final_eval_mean"] for r in results if r["variant"] == HONEST_ONLY and r["final_eval_mean"] is not None]
    return statistics.median(means) if means else None


def markdown(results: list[dict[str, Any]], command: str, environment: str) -> str:
    """The table: every variant's honest final eval against the median of the honest-only runs'."""
    baseline = baseline_eval(results)
    lines = ["# One modified unit among honest ones (tiny model, 127.0.0.1)", "",
             "Reproduce:", "", f"    {command}", "", environment, "",
             f"Reference (vs honest-only): the median of the honest-only runs, {_fmt(baseline)}.", "",
             "| variant | honest units' final eval (mean) | vs honest-only | spread | max φ distance | mean group | "
             "failed rounds | defences logged (count) | honest exits |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        mean = r["final_eval_mean"]
        gap = f"{(mean / baseline - 1) * 100:+.2f}%" if mean is not None and baseline else "n/a"
        defences = ", ".join(f"{name} {count}" for name, count in r["defences"].items() if count) or "none"
        lines.append(f"| {r['variant']} | {_fmt(mean)} | {gap} | {_fmt(r['final_eval_spread'])} | "
                     f"{_fmt(r['final_max_distance'], '.1e')} | {_fmt(r['mean_group'], '.2f')} | "
                     f"{r['rounds_failed']} | {defences} | {sorted(r['exit_codes'].values())} |")  # fmt: skip
    return "\n".join([*lines, "", *direction_table(results)]) + "\n"


def direction_table(results: list[dict[str, Any]]) -> list[str]:
    """Every variant's step agreements (each member's step against each honest unit's own, one per member and round
    of an honest unit's slice) and the lines that judged a member's steps as pulling against the unit's."""
    lines = ["Directions: each member's step against each honest unit's own over the unit's slice (cosine; one "
             "value per member, round and honest unit), and the log lines that judged a member's steps to pull "
             "against the unit's (mean under AGREEMENT_FLOOR over its last judged rounds).", "",
             "| variant | honest members' rounds | min / median / max | red member's rounds | min / median / max | "
             "judged pulling: honest / red |", "|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        found = r.get("directions")
        if not found:
            continue
        honest, red = found["agreements"]["honest"], found["agreements"]["red"]
        pulling = found["pulling"]
        lines.append(f"| {r['variant']} | {len(honest)} | {_spread(honest)} | {len(red)} | {_spread(red)} | "
                     f"{pulling['honest']} / {pulling['red']} |")  # fmt: skip
    return lines


def _spread(values: list[float]) -> str:
    if not values:
        return "n/a"
    return f"{min(values):+.2f} / {statistics.median(values):+.2f} / {max(values):+.2f}"


def _fmt(value: float | None, spec: str = ".4f") -> str:
    return "n/a" if value is None else format(value, spec)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """One bar per variant: the honest units' final eval relative to the honest-only run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    baseline = baseline_eval(results)
    shown = [r for r in results if r["final_eval_mean"] is not None and baseline]
    figure, axes = plt.subplots(figsize=(9, 4))
    labels = [
        f"{r['variant']} {index}" if r["variant"] == HONEST_ONLY else r["variant"] for index, r in enumerate(shown)
    ]
    axes.bar(labels, [(r["final_eval_mean"] / baseline - 1) * 100 for r in shown])
    axes.axhline(2.0, color="red", linestyle="--", linewidth=1, label="target: within 2%")
    axes.set_ylabel("honest final eval vs honest-only (%)")
    axes.tick_params(axis="x", rotation=30)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def checkout_cli(checkout: Path) -> list[str]:
    """The CLI of the package in another checkout (e.g. the last commit before the defences), run by this Python."""
    program = f"import sys; sys.path.insert(0, {str(checkout)!r}); from p2p_diloco import cli; sys.exit(cli.main())"
    return [CLI[0], "-c", program]


def run_cost(root: Path, cli: list[str], honest: int, max_steps: int) -> dict[str, Any]:
    """``honest`` units of ``cli`` alone (no attacker, fresh identities), ``max_steps`` each, measured by
    :func:`measure_cost`."""
    swarm = Swarm(root, run_id=RUN_ID, unit_flags=(*UNIT_FLAGS, "--max-steps", str(max_steps)))
    names = [f"unit{index}" for index in range(honest)]
    try:
        maddr = swarm.bootstrap("bootstrap")
        for name in names:
            swarm.unit(name, [maddr], cli=cli)
        swarm.wait_for(lambda: all(not swarm.running(name) for name in names), timeout_s=1800,
                       what="the units to finish their steps")  # fmt: skip
    finally:
        swarm.close(grace_s=EXIT_GRACE_S)
    return measure_cost(root, names)


def measure_cost(root: Path, names: list[str]) -> dict[str, Any]:
    """The median over units ``names`` (work dirs under ``root``) of their wall time per inner step after
    COST_FROM_STEP, and the bytes all of them sent (their p2p daemons' TCP counters at exit) over the rounds of two or
    more members they merged (fragment, consensus and settle rounds: all of them exchange tensors)."""
    step_ms, sent, merged, groups = [], 0, 0, []
    for name in names:
        metrics = root / name / "metrics.jsonl"
        steps = [event for event in read_events(metrics, InnerStep) if event.step >= COST_FROM_STEP]
        if len(steps) >= 2:
            step_ms.append(1000 * (steps[-1].time - steps[0].time) / (steps[-1].step - steps[0].step))
        stops = read_events(metrics, Stop)
        sent += (stops[-1].wire_bytes_sent or 0) if stops else 0
        rounds = [event for event in read_events(metrics, OuterRound) if event.group_size > 1]
        groups += [event.group_size for event in rounds]
        merged += len(rounds) + sum(event.group_size > 1 for event in read_events(metrics, ConsensusRound))
    return {
        "step_ms": statistics.median(step_ms) if step_ms else None,
        "bytes_per_round": sent / merged if merged and sent else None,
        "mean_group": statistics.fmean(groups) if groups else None,
        "units": len(step_ms),
    }


def cost_markdown(repeats: list[dict[str, Any]], command: str, environment: str) -> str:
    """Per repeat: the baseline's and these defences' step time and bytes per round, and their ratios."""
    lines = ["# What the defences cost without attackers (tiny model, 127.0.0.1)", "", "Reproduce:", "",
             f"    {command}", "", environment, "",
             "| repeat | baseline ms/step | defended ms/step | ratio | baseline KiB/merged round | "
             "defended KiB/merged round | ratio | mean group, baseline / defended |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for index, pair in enumerate(repeats):
        base, ours = pair["baseline"], pair["defended"]
        lines.append(f"| {index} | {_fmt(base['step_ms'], '.1f')} | {_fmt(ours['step_ms'], '.1f')} | "
                     f"{_fmt(_over(ours['step_ms'], base['step_ms']), '.3f')} | "
                     f"{_fmt(_kib(base['bytes_per_round']), '.0f')} | "
                     f"{_fmt(_kib(ours['bytes_per_round']), '.0f')} | "
                     f"{_fmt(_over(ours['bytes_per_round'], base['bytes_per_round']), '.3f')} | "
                     f"{_fmt(base['mean_group'], '.2f')} / {_fmt(ours['mean_group'], '.2f')} |")  # fmt: skip
    step_ratios = [r for r in (_over(p["defended"]["step_ms"], p["baseline"]["step_ms"]) for p in repeats) if r]
    byte_ratios = [r for r in (_over(p["defended"]["bytes_per_round"], p["baseline"]["bytes_per_round"])
                               for p in repeats) if r]  # fmt: skip
    if step_ratios and byte_ratios:
        lines += ["", f"Median ratios: step time {statistics.median(step_ratios):.3f}, "
                      f"bytes per merged round {statistics.median(byte_ratios):.3f}."]  # fmt: skip
    return "\n".join(lines) + "\n"


def _over(value: float | None, base: float | None) -> float | None:
    return value / base if value is not None and base else None


def _kib(value: float | None) -> float | None:
    return None if value is None else value / 1024


def cost_plot(repeats: list[dict[str, Any]], path: Path) -> None:
    """Step time and bytes per round of the defended run relative to the baseline's, per repeat."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for offset, (key, label) in enumerate((("step_ms", "ms per inner step"), ("bytes_per_round", "bytes per round"))):
        ratios = [_over(pair["defended"][key], pair["baseline"][key]) or 0.0 for pair in repeats]
        axes.bar([index * 3 + offset for index in range(len(repeats))], [(r - 1) * 100 for r in ratios], label=label)
    axes.axhline(3.0, color="red", linestyle="--", linewidth=1, label="step-time target: +3%")
    axes.axhline(10.0, color="orange", linestyle=":", linewidth=1, label="bytes target: +10%")
    axes.set_xticks([index * 3 + 0.5 for index in range(len(repeats))], [f"repeat {i}" for i in range(len(repeats))])
    axes.set_ylabel("defended vs baseline (%)")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
