#!/usr/bin/env python
"""Group formation and consensus beyond one machine: the simulator (bench/simulate.py) fitted to the measured swarm
benchmark (scripts/scale.py), checked against every measured run, then predicting larger swarms.

    .venv/bin/python scripts/simulate.py --measured results/scale/grid/scale.json --out results/simulate

Writes simulate.json, simulate.md and simulate.png to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the laboratory, bench/, lives in the checkout

from bench.simulate import SimSpec, fit_meeting, fit_noise, implied_miss, simulate  # noqa: E402
from bench.simulate_report import compare_rows, markdown, plot  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measured", type=Path, nargs="+", required=True, help="scale.json files of scripts/scale.py")
    parser.add_argument("--out", type=Path, required=True, help="results folder")
    parser.add_argument("--reference", default="clock-n8-g8", help="the run step jitter and miss are fitted to")
    parser.add_argument("--noise-reference", default="clock-n8-g3", help="the run (with lineages) noise is fitted to")
    parser.add_argument("--large", type=int, nargs="+", default=[100, 1000], help="swarm sizes to predict")
    parser.add_argument("--repeats", type=int, default=3, help="seeds per simulated swarm (median)")
    parser.add_argument("--duration-s", type=float, default=300.0, help="simulated training of the predictions")
    return parser


def spec_of(run: dict, **changes: object) -> SimSpec:
    """The simulated twin of a measured run: its size, group, schedule, length and measured timings."""
    timings = run["timings"]
    base = SimSpec(units=run["units"], target_group=run["target_group"],
                   schedule="clock" if run["variant"] == "clock" else "steps", duration_s=run["train_window_s"],
                   step_time_s=timings["step_time_s"], step_spread=timings["step_spread"],
                   latency_s=timings["latency_s"], latency_per_member_s=timings["latency_per_member_s"])  # fmt: skip
    return replace(base, **changes)  # type: ignore[arg-type]


def main() -> int:
    args = _parser().parse_args()
    try:
        measured = [run for path in args.measured for run in json.loads(path.read_text())["runs"]]
        reference, noise_reference = (next(run for run in measured if run["name"] == name)
                                      for name in (args.reference, args.noise_reference))  # fmt: skip
    except (OSError, ValueError, KeyError, StopIteration):
        names = f"{args.reference} and {args.noise_reference}"
        print(f"error: {' '.join(map(str, args.measured))} do not hold runs named {names}", file=sys.stderr)
        return 2
    meeting = fit_meeting(spec_of(reference), reference["mean_group"], reference["one_model_share"])
    noise = fit_noise(spec_of(noise_reference, step_jitter=meeting.step_jitter, miss=meeting.miss),
                      noise_reference["distance_during"]["p90"]).noise  # fmt: skip
    fit = {"noise": noise, "step_jitter": meeting.step_jitter, "miss": meeting.miss}
    print(f"fitted to {args.reference} and {args.noise_reference}: {fit}", flush=True)
    runs = [run for run in measured if run["variant"] != "settle"]
    checks = [(run, simulate(spec_of(run, **fit), args.repeats)) for run in runs]
    misses = {run["name"]: implied_miss(spec_of(run, **fit), run["one_model_share"]) for run in runs}
    predictions = []
    for units in args.large:
        for churn in (0.0, 10.0):
            spec = spec_of(reference, units=units, churn_per_hour=churn, duration_s=args.duration_s, **fit)
            print(f"predicting {units} units, churn {churn:.0f}%/h", flush=True)
            predictions.append(simulate(spec, args.repeats if units <= 100 else 1))
    command = " ".join([Path(sys.executable).name, *sys.argv])
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"command": command, **fit, "reference": args.reference, "noise_reference": args.noise_reference,
              "checks": compare_rows(checks, misses), "predictions": predictions}  # fmt: skip
    (args.out / "simulate.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "simulate.md").write_text(markdown(report))
    plot(report, args.out / "simulate.png")
    print((args.out / "simulate.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
