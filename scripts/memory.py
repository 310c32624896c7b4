#!/usr/bin/env python
"""Peak memory per trained parameter of a lone learning unit against a bare training loop (bench/memory.py).

    .venv/bin/python scripts/memory.py --out results/memory --models tiny smollm2-135m

Runs one process tree at a time. Writes memory.json, memory.md and memory.png to --out (and every run's work dir
under --out/runs). SmolLM2-135M is read from --smollm2-dir, a plain Hugging Face folder (see ASSETS.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the laboratory, bench/, lives in the checkout

from bench.memory import SMOLLM2_DIR, VARIANTS, measure, models, refreshed  # noqa: E402
from bench.memory_report import markdown, plot, summary  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="results folder")
    parser.add_argument("--models", nargs="+", default=list(models()), choices=list(models()), help="models to run")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS, help="unit settings")
    parser.add_argument("--steps", type=int, help="inner steps of every run (default: each model's own)")
    parser.add_argument(
        "--render", action="store_true", help="only redo the inventory, memory.md and memory.png from memory.json"
    )
    parser.add_argument("--smollm2-dir", type=Path, default=SMOLLM2_DIR, help=f"(default {SMOLLM2_DIR})")
    return parser


def _render(report: dict, out: Path) -> None:
    table = markdown(report)
    (out / "memory.md").write_text(table + "\n")
    plot(report, out / "memory.png")
    print(table)


def main() -> int:
    args = _parser().parse_args()
    if args.render:
        report = refreshed(json.loads((args.out / "memory.json").read_text()))
        (args.out / "memory.json").write_text(json.dumps(report, indent=1) + "\n")
        _render(report, args.out)
        return 0
    command = [Path(sys.executable).name, *sys.argv]
    chosen = {name: spec for name, spec in models(args.smollm2_dir).items() if name in args.models}
    try:
        measured = measure(args.out, chosen, {v: VARIANTS[v] for v in args.variants}, args.steps)
    except (ValueError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    report = summary(measured, command)
    (args.out / "memory.json").write_text(json.dumps(report, indent=1) + "\n")
    _render(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
