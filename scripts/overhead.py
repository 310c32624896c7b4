#!/usr/bin/env python
"""Overhead of a learning unit's outer machinery on its inner step time, on an idle network (bench/overhead.py).

    .venv/bin/python scripts/overhead.py --steps 400 --repeats 3 --out /tmp/overhead

Writes overhead.json, overhead.md and overhead.png to --out (and every run's work dir under --out/runs).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the laboratory, bench/, lives in the checkout

from bench.overhead import VARIANTS, markdown, measure, plot, summary  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="results folder")
    parser.add_argument("--steps", type=int, default=400, help="inner steps of every run (default 400)")
    parser.add_argument("--repeats", type=int, default=3, help="A/B alternations (default 3)")
    parser.add_argument("--from-step", type=int, default=50, help="first step of the timed window (default 50)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS, help="lone-unit settings")
    return parser


def main() -> int:
    args = _parser().parse_args()
    command = [Path(sys.executable).name, *sys.argv]
    try:
        results = measure(args.out, args.steps, args.repeats, args.from_step, {v: VARIANTS[v] for v in args.variants})
    except (ValueError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    report = summary(results, args.steps, args.from_step, command)
    (args.out / "overhead.json").write_text(json.dumps(report, indent=1) + "\n")
    table = markdown(report)
    (args.out / "overhead.md").write_text(table + "\n")
    plot(report, args.out / "overhead.png")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
