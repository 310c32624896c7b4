#!/usr/bin/env python
"""Consensus at swarm scale: N units of the tiny preset on this machine, side by side with today's behaviour
(bench/scale.py).

    .venv/bin/python scripts/scale.py --out results/scale --units 4 8 16 --groups 8 3 --duration-s 120

Writes scale.json, scale.md and scale.png to --out (every run's work dirs under --out/runs, deleted unless --keep-runs).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the laboratory, bench/, lives in the checkout

from bench.scale import VARIANTS, RunSpec, measure_run, run_swarm  # noqa: E402
from bench.scale_report import markdown, plot  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="results folder")
    parser.add_argument("--units", type=int, nargs="+", default=[4, 8, 16], help="swarm sizes (default 4 8 16)")
    parser.add_argument("--groups", type=int, nargs="+", default=[8, 3], help="target group sizes (default 8 3)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS, help="schedules to compare")
    parser.add_argument("--duration-s", type=float, default=120.0, help="training after every unit joined")
    parser.add_argument("--only-4-with-group", type=int, default=8, help="4 units run with this target group only")
    parser.add_argument("--keep-runs", action="store_true", help="keep the units' work dirs under --out/runs")
    return parser


def main() -> int:
    args = _parser().parse_args()
    if min(args.units) < 2 or min(args.groups) < 2 or args.duration_s <= 0:
        print("error: --units and --groups must be at least 2 and --duration-s positive", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    runs = args.out / "runs"
    results_path = args.out / "scale.json"
    results = json.loads(results_path.read_text())["runs"] if results_path.exists() else []
    specs = [RunSpec(units, group, variant) for units in args.units for group in args.groups
             for variant in args.variants if units != 4 or group == args.only_4_with_group]  # fmt: skip
    command = " ".join([Path(sys.executable).name, *sys.argv])
    environment = f"{platform.node()}: {platform.processor() or platform.machine()}, Python {platform.python_version()}"
    for spec in specs:
        print(f"running {spec.name} ({args.duration_s:.0f} s of training)", flush=True)
        raw = run_swarm(spec, runs, args.duration_s)
        result = {**measure_run(runs / spec.name, raw), "command": command}
        results = [r for r in results if r["name"] != result["name"]] + [result]
        results.sort(key=lambda r: (r["units"], -r["target_group"], r["variant"]))
        results_path.write_text(json.dumps({"command": command, "environment": environment, "runs": results}) + "\n")
        (args.out / "scale.md").write_text(markdown(results, environment))
        plot(results, args.out / "scale.png")
        if not args.keep_runs:
            shutil.rmtree(runs / spec.name, ignore_errors=True)
    print((args.out / "scale.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
