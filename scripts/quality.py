#!/usr/bin/env python
"""Model quality at equal tokens: data-parallel, synchronous DiLoCo with M units and ours-async, in one process
(bench/quality.py).

    .venv/bin/python scripts/quality.py --out results/quality --tokens 2000000 --units 1 2 4 8 --async-units 4
    .venv/bin/python scripts/quality.py --out /tmp/sweep --tokens 500000 --units 2 4 --async-units \
        --outer-sets outer_lr=0.7,outer_momentum=0.9 outer_lr=1.0,outer_momentum=0.0

Writes quality.json, quality.md and quality.png to --out. ``--set section__field=value`` changes what every method
trains (model, data, inner settings over the tiny preset); ``--outer field=value`` the DiLoCo methods' outer step.
"""

from __future__ import annotations

import argparse
import platform
import shlex
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the laboratory, bench/, lives in the checkout

from bench.quality import (  # noqa: E402
    MEASURED_DELAY_STEPS,
    Budget,
    Method,
    MethodResult,
    add_method_arguments,
    diloco_methods,
    run_comparison,
)
from bench.quality_report import write_report  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="results folder")
    parser.add_argument("--tokens", type=int, required=True, help="token budget of every method (all units)")
    add_method_arguments(parser)
    parser.add_argument("--delay-steps", type=int, default=MEASURED_DELAY_STEPS, help="ours-async: overlap steps")
    parser.add_argument(
        "--data-parallel-units",
        type=int,
        nargs="*",
        default=None,
        help="data-parallel's combined batches, in units (default: every M; 1 is plain AdamW; none: no data-parallel)",
    )
    parser.add_argument("--evals", type=int, default=8, help="eval points per method")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    return parser


def _print_result(result: MethodResult) -> None:
    print(f"{result.method.name}: eval loss {result.final_loss:.4f} after {result.tokens:,} tokens, "
          f"{result.rounds} rounds, {result.seconds:.0f} s", flush=True)  # fmt: skip


def main() -> int:
    args = _parser().parse_args()
    torch.set_num_threads(args.threads)
    sizes = sorted(set(args.units) | set(args.async_units)) if args.data_parallel_units is None else []
    methods = [Method("plain-adamw" if units == 1 else f"data-parallel-m{units}", "data-parallel", units)
               for units in (args.data_parallel_units or sizes)]  # fmt: skip
    methods += diloco_methods(args.units, args.async_units, args.outer_sets, dict(args.outer), args.alone_p,
                              args.delay_steps)  # fmt: skip
    budget = Budget(args.tokens, args.evals, args.seed, dict(args.set))
    command = shlex.join([Path(sys.executable).name, *sys.argv])
    environment = f"{platform.node()}: {platform.processor() or platform.machine()}, Python {platform.python_version()}"
    try:
        results = run_comparison(methods, budget, report=_print_result)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    write_report(results, budget, args.out, command, environment)
    print((args.out / "quality.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
