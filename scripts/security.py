#!/usr/bin/env python
"""One modified unit among honest ones, per red-team variant, against the honest units alone (bench/security.py).

    .venv/bin/python scripts/security.py --out results/security

Writes security.json, security.md and security.png to --out (the runs' work dirs under --out/runs, deleted unless
--keep-runs). About 90 s per variant on a 2-core machine.

    git worktree add /tmp/before-defences 064160b
    .venv/bin/python scripts/security.py --out results/security --cost-baseline /tmp/before-defences

measures instead what the defences cost without attackers: honest units of that checkout (the last commit before
the defences) and of this one, alternately, --cost-repeats times; writes cost.json, cost.md and cost.png.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the laboratory, bench/, lives in the checkout

import torch  # noqa: E402

from bench.security import (  # noqa: E402
    HONEST_ONLY,
    VARIANTS,
    SecuritySpec,
    checkout_cli,
    cost_markdown,
    cost_plot,
    markdown,
    plot,
    run_cost,
    run_variant,
)
from p2p_diloco.ops.launcher import CLI  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="results folder")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS, help="what to run")
    parser.add_argument("--honest", type=int, default=3, help="honest units (default 3: 1 modified of 4)")
    parser.add_argument("--max-steps", type=int, default=200, help="inner steps of every honest unit")
    parser.add_argument(
        "--baseline-repeats", type=int, default=3, help="runs of honest-only (the reference is their median; default 3)"
    )
    parser.add_argument("--keep-runs", action="store_true", help="keep the units' work dirs under --out/runs")
    parser.add_argument("--cost-baseline", type=Path, help="a checkout to compare step time and bytes against")
    parser.add_argument("--cost-repeats", type=int, default=2, help="baseline/defended pairs (with --cost-baseline)")
    return parser


def main() -> int:
    args = _parser().parse_args()
    if args.honest < 1 or args.max_steps < 1 or args.baseline_repeats < 1:
        print("error: --honest, --max-steps and --baseline-repeats must be at least 1", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    if args.cost_baseline is not None:
        return measure_cost(args)
    runs, identities = args.out / "runs", args.out / "runs" / "identities"
    identities.mkdir(parents=True, exist_ok=True)
    results = []
    for variant in args.variants:
        for repeat in range(args.baseline_repeats if variant == HONEST_ONLY else 1):
            spec = SecuritySpec(variant, honest=args.honest, max_steps=args.max_steps)
            result = run_variant(spec, runs / f"{variant}-{repeat}", identities)
            results.append(result)
            print(f"{variant}: honest final eval {result['final_eval']} defences {result['defences']}", flush=True)
    command, environment = _command(), _environment(f"{args.honest} honest units", args.max_steps)
    table = markdown(results, command, environment)
    return _write(
        args, "security", {"command": command, "results": results}, table, lambda path: plot(results, path), runs
    )


def measure_cost(args: argparse.Namespace) -> int:
    if not (args.cost_baseline / "p2p_diloco" / "cli.py").is_file() or args.cost_repeats < 1:
        print("error: --cost-baseline must be a checkout of this project, --cost-repeats at least 1", file=sys.stderr)
        return 2
    runs, repeats = args.out / "cost-runs", []
    for index in range(args.cost_repeats):
        order = ["baseline", "defended"] if index % 2 == 0 else ["defended", "baseline"]  # cancel machine drift
        pair = {}
        for kind in order:
            cli = checkout_cli(args.cost_baseline) if kind == "baseline" else list(CLI)
            pair[kind] = run_cost(runs / f"{index}-{kind}", cli, args.honest, args.max_steps)
            print(f"repeat {index} {kind}: {pair[kind]}", flush=True)
        repeats.append(pair)
    command = _command()
    environment = _environment(f"{args.honest} units", args.max_steps) + f" Baseline: {args.cost_baseline}."
    table = cost_markdown(repeats, command, environment)
    return _write(
        args, "cost", {"command": command, "repeats": repeats}, table, lambda path: cost_plot(repeats, path), runs
    )


def _command() -> str:
    return "python scripts/security.py " + shlex.join(sys.argv[1:])


def _environment(units: str, max_steps: int) -> str:
    return (f"Environment: {platform.platform()}, Python {platform.python_version()}, torch {torch.__version__}, "
            f"{units} of the tiny preset, {max_steps} inner steps each.")  # fmt: skip


def _write(args: argparse.Namespace, name: str, record: dict, table: str, draw: Callable[[Path], None],
           runs: Path) -> int:  # fmt: skip
    """``name``.json, .md and .png in --out; the runs' work dirs deleted unless --keep-runs."""
    (args.out / f"{name}.json").write_text(json.dumps(record, indent=2))
    (args.out / f"{name}.md").write_text(table)
    draw(args.out / f"{name}.png")
    if not args.keep_runs:
        shutil.rmtree(runs, ignore_errors=True)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
