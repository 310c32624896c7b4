#!/usr/bin/env python
"""Chaos comparison of our decoupled swarm against synchronous baselines under one seeded fault schedule.

    .venv/bin/python scripts/chaos.py --budget-s 60 --methods ours sync-dp --out /tmp/chaos-smoke

The command of the committed run (results/chaos/) is in README.md and in results/chaos/results.md. Partitions need
network namespaces: add --namespaces --partition-mtbf-s S (root only). Bad input prints one ``error:`` line, exit 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the laboratory, bench/, lives in the checkout

from bench.chaos.benchmark import METHODS, ChaosConfig, run_chaos_benchmark  # noqa: E402
from bench.chaos.namespaces import NamespaceError  # noqa: E402
from bench.chaos.schedule import FaultRates  # noqa: E402
from bench.chaos.script import run_benchmark  # noqa: E402
from bench.training import TrainingSetup  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="results folder (results.json/.md/.png, logs)")
    parser.add_argument("--units", type=int, default=4, help="M learning units / ranks (default 4)")
    parser.add_argument("--budget-s", type=float, default=240.0, help="wall-time budget of each method (default 240)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault schedule and of training")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--start-after-s", type=float, default=30.0, help="no fault before this offset (default 30)")
    parser.add_argument("--crash-mtbf-s", type=float, default=300.0, help="mean time between crashes per unit")
    parser.add_argument("--recovery-s", type=float, default=20.0, help="a crashed unit's machine is back after this")
    parser.add_argument("--straggler-mtbf-s", type=float, default=600.0, help="mean time between freezes per unit")
    parser.add_argument("--straggler-s", type=float, default=10.0, help="how long a straggler stays frozen")
    parser.add_argument("--partition-mtbf-s", type=float, default=None, help="mean time between partitions per unit")
    parser.add_argument("--partition-s", type=float, default=15.0, help="how long a partition lasts")
    parser.add_argument("--bootstrap-crash-at-s", type=float, default=100.0, help="crash the bootstrap node then")
    parser.add_argument("--bootstrap-down-s", type=float, default=60.0, help="the bootstrap node is back after this")
    parser.add_argument("--namespaces", action="store_true", help="one network namespace per node (root)")
    parser.add_argument("--inner-steps", type=int, default=20, help="H (default 20)")
    parser.add_argument(
        "--report-only", action="store_true", help="rebuild the report from the logs of an earlier run in --out"
    )
    parser.add_argument("--eval-every-steps", type=int, default=100, help="eval cadence in inner steps (default 100)")
    return parser


def _config(args: argparse.Namespace) -> ChaosConfig:
    """Raises ValueError for invalid values."""
    return ChaosConfig(
        units=args.units,
        budget_s=args.budget_s,
        seed=args.seed,
        rates=FaultRates(
            crash_mtbf_s=args.crash_mtbf_s,
            recovery_s=args.recovery_s,
            straggler_mtbf_s=args.straggler_mtbf_s,
            straggler_s=args.straggler_s,
            partition_mtbf_s=args.partition_mtbf_s,
            partition_s=args.partition_s,
            bootstrap_crash_at_s=args.bootstrap_crash_at_s,
            bootstrap_down_s=args.bootstrap_down_s,
        ),
        setup=TrainingSetup(inner_steps=args.inner_steps, eval_every_steps=args.eval_every_steps, seed=args.seed),
        out_dir=args.out,
        methods=tuple(args.methods),
        start_after_s=args.start_after_s,
        use_namespaces=args.namespaces,
    )


def main() -> int:
    return run_benchmark(_parser().parse_args(), _config, run_chaos_benchmark, (NamespaceError,))


if __name__ == "__main__":
    sys.exit(main())
