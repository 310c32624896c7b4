#!/usr/bin/env python
"""A real swarm against synchronous DiLoCo at equal tokens (bench/swarm_quality.py): runs of the scale benchmark,
kept with ``--keep-runs``, each beside the in-process bench's synchronous and replayed-async DiLoCo of as many units.

    .venv/bin/python scripts/scale.py --out /tmp/s8 --units 8 --groups 8 --variants clock --duration-s 180 --keep-runs
    .venv/bin/python scripts/swarm_quality.py --runs /tmp/s8/runs/clock-n8-g8 --out results/scale/quality

Writes swarm_quality.json, swarm_quality.md and swarm_quality.png to --out.
"""

from __future__ import annotations

import argparse
import platform
import shlex
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the laboratory, bench/, lives in the checkout

from bench.swarm_quality import comparison, in_process, read_swarm, write_report  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=Path, nargs="+", required=True, help="kept run folders of scripts/scale.py")
    parser.add_argument("--out", type=Path, required=True, help="results folder")
    parser.add_argument("--seed", type=int, default=0, help="the in-process methods' seed")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    try:
        swarms = [read_swarm(path) for path in args.runs]
    except (OSError, ValueError, KeyError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    runs = []
    for swarm in swarms:
        print(f"{swarm.name}: {swarm.units} units, {swarm.tokens:,} tokens; in-process methods next", flush=True)
        runs.append(comparison(swarm, in_process(swarm, args.seed)))
    environment = f"{platform.node()}: {platform.processor() or platform.machine()}, Python {platform.python_version()}"
    report = {"command": shlex.join([Path(sys.executable).name, *sys.argv]), "environment": environment, "runs": runs}
    write_report(report, args.out)
    print((args.out / "swarm_quality.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
