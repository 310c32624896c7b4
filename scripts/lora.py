#!/usr/bin/env python
"""LoRA adapters against full fine-tuning of the same pretrained base, side by side (bench/lora.py).

    .venv/bin/python scripts/lora.py --out results/lora

Writes lora.json, lora.md and lora.png to --out (the base and the units' work dirs go under --out/runs, deleted unless
--keep-runs). About 5 minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the laboratory, bench/, lives in the checkout

from bench.lora import METHODS, pretrained_base, run_method, write_report  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--units", type=int, default=2)
    parser.add_argument("--steps", type=int, default=600, help="inner steps of each unit")
    parser.add_argument("--base-steps", type=int, default=300, help="pre-training steps of the base")
    parser.add_argument("--keep-runs", action="store_true", help="keep the units' work dirs")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = args.out / "runs"
    base = pretrained_base(runs, args.base_steps)
    results = [run_method(runs, method, base, args.units, args.steps) for method in METHODS]
    write_report(args.out, results, shlex.join(["python", *sys.argv]), args.base_steps)
    if not args.keep_runs:
        shutil.rmtree(runs)
    print((args.out / "lora.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
