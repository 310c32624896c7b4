#!/usr/bin/env python
"""WAN comparison of our swarm (plain and streaming with compressed pseudo-gradients) against synchronous baselines,
every node behind its own rate-limited link (network namespaces and tbf; root only).

    .venv/bin/python scripts/wan.py --units 2 --budget-s 60 --rate-mbit 20 --out /tmp/wan-smoke

Bad input prints one ``error:`` line and exits 2. Extra ``p2p-diloco join`` flags for our methods go in one string:
``--swarm-flags="--allreduce-timeout-s 60"``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the laboratory, bench/, lives in the checkout

from bench.chaos.namespaces import NamespaceError  # noqa: E402
from bench.chaos.script import run_benchmark  # noqa: E402
from bench.training import TrainingSetup  # noqa: E402
from bench.wan.benchmark import METHODS, RunFolderError, WanConfig, run_wan_benchmark  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/wan-run"), help="results folder (results.*, logs)")
    parser.add_argument("--units", type=int, default=4, help="M learning units / ranks (default 4)")
    parser.add_argument("--budget-s", type=float, default=300.0, help="wall-time budget of each method (default 300)")
    parser.add_argument(
        "--method-budget-s",
        action="append",
        default=[],
        metavar="METHOD=SECONDS",
        help="one method's own budget instead of --budget-s (repeatable), e.g. sync-dp=1500 so that it reaches the "
        "losses the others reach",
    )
    parser.add_argument(
        "--rate-mbit",
        type=float,
        required=True,
        help="rate of every node's link, each way, in Mbit/s; derive it from the compute speed of this machine as "
        "results/wan/README.md explains (a WAN uplink scaled to the tiny model's step time)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of training (weights and data order)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--fragments", type=int, default=4, help="P of ours-streaming (default 4)")
    parser.add_argument("--codec", default="int8", help="wire codec of ours-streaming: fp32, fp16 or int8 (default)")
    parser.add_argument(
        "--max-in-flight", type=int, default=2, help="most rounds in flight at once in ours-streaming (default 2)"
    )
    parser.add_argument(
        "--target-loss", type=float, default=None, help="eval loss to time (default: the highest best loss of all)"
    )
    parser.add_argument("--swarm-flags", default="", help="extra p2p-diloco join flags of our methods, one string")
    parser.add_argument("--inner-steps", type=int, default=20, help="H (default 20)")
    parser.add_argument("--eval-every-steps", type=int, default=100, help="eval cadence in inner steps (default 100)")
    parser.add_argument(
        "--report-only", action="store_true", help="rebuild the report from the logs of an earlier run in --out"
    )
    return parser


def _method_budgets(pairs: list[str]) -> dict[str, float]:
    """``METHOD=SECONDS`` pairs as a mapping; raises ValueError naming a malformed pair."""
    budgets = {}
    for pair in pairs:
        method, _, seconds = pair.partition("=")
        try:
            budgets[method] = float(seconds)
        except ValueError:
            raise ValueError(f"--method-budget-s takes METHOD=SECONDS, got {pair!r}") from None
    return budgets


def _config(args: argparse.Namespace) -> WanConfig:
    """Raises ValueError for invalid values."""
    return WanConfig(
        units=args.units,
        budget_s=args.budget_s,
        seed=args.seed,
        rate_mbit=args.rate_mbit,
        setup=TrainingSetup(inner_steps=args.inner_steps, eval_every_steps=args.eval_every_steps, seed=args.seed),
        out_dir=args.out,
        methods=tuple(args.methods),
        fragments=args.fragments,
        codec=args.codec,
        max_in_flight=args.max_in_flight,
        target_loss=args.target_loss,
        swarm_flags=tuple(shlex.split(args.swarm_flags)),
        method_budgets_s=_method_budgets(args.method_budget_s),
    )


def main() -> int:
    return run_benchmark(_parser().parse_args(), _config, run_wan_benchmark, (RunFolderError, NamespaceError))


if __name__ == "__main__":
    sys.exit(main())
