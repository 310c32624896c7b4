#!/usr/bin/env python
"""One modified unit among honest ones, per red-team variant, against the honest units alone (bench/security.py).

    .venv/bin/python scripts/security.py --out results/security

Writes security.json, security.md and security.png to --out (the runs' work dirs under --out/runs, deleted unless
--keep-runs). About 90 s per variant on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the laboratory, bench/, lives in the checkout

import torch  # noqa: E402

from bench.security import VARIANTS, SecuritySpec, markdown, plot, run_variant  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="results folder")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS, help="what to run")
    parser.add_argument("--honest", type=int, default=3, help="honest units (default 3: 1 modified of 4)")
    parser.add_argument("--max-steps", type=int, default=200, help="inner steps of every honest unit")
    parser.add_argument("--keep-runs", action="store_true", help="keep the units' work dirs under --out/runs")
    return parser


def main() -> int:
    args = _parser().parse_args()
    if args.honest < 1 or args.max_steps < 1:
        print("error: --honest and --max-steps must be at least 1", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    runs, identities = args.out / "runs", args.out / "runs" / "identities"
    identities.mkdir(parents=True, exist_ok=True)
    results = []
    for variant in args.variants:
        spec = SecuritySpec(variant, honest=args.honest, max_steps=args.max_steps)
        result = run_variant(spec, runs / variant, identities)
        results.append(result)
        print(f"{variant}: honest final eval {result['final_eval']} defences {result['defences']}", flush=True)
    command = "python scripts/security.py " + shlex.join(sys.argv[1:])
    environment = (f"Environment: {platform.platform()}, Python {platform.python_version()}, "
                   f"torch {torch.__version__}, {args.honest} honest units of the tiny preset, "
                   f"{args.max_steps} inner steps each.")  # fmt: skip
    (args.out / "security.json").write_text(json.dumps({"command": command, "results": results}, indent=2))
    (args.out / "security.md").write_text(markdown(results, command, environment))
    plot(results, args.out / "security.png")
    if not args.keep_runs:
        shutil.rmtree(runs, ignore_errors=True)
    print((args.out / "security.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
