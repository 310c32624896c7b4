#!/usr/bin/env python
"""Memory of a swarm's units at their common stop against their memory while training (bench/exit_memory.py).

    .venv/bin/python scripts/exit_memory.py --out results/memory/exit --units 3 --train-s 420

Fine-tunes SmolLM2-135M (the CPU preset, peers/configs/cpu.toml, read from --smollm2-dir and the embedded corpus
instead of the hub, a round every 10 inner steps, 4 x 128 tokens per step) in --units units on this machine.
Writes exit_memory.json, exit_memory.md and exit_memory.png to --out (every unit's work dir under --out/runs, with
its 2.15 GB checkpoint and its export: delete them after); exits 1 when a unit failed, wrote no export, or peaked
higher at exit than while training. Takes about 10 minutes and 22 GiB of memory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the laboratory, bench/, lives in the checkout

import torch  # noqa: E402

from bench import CHECKOUT  # noqa: E402
from bench.exit_memory import markdown, passed, plot, run_swarm  # noqa: E402
from bench.memory import SMOLLM2_DIR  # noqa: E402
from p2p_diloco.presets import CORPUS  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="results folder")
    parser.add_argument("--units", type=int, default=3, help="units of the swarm (default 3)")
    parser.add_argument(
        "--train-s",
        type=float,
        default=420.0,
        help="the common stop, seconds after the units start (default 420; loading takes about 60)",
    )
    parser.add_argument("--inner-steps", type=int, default=10, help="inner steps per outer round (default 10)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="the whole run's bound (default 1800)")
    parser.add_argument("--smollm2-dir", type=Path, default=SMOLLM2_DIR, help=f"(default {SMOLLM2_DIR})")
    return parser


def main() -> int:
    args = _parser().parse_args()
    if not (args.smollm2_dir / "config.json").exists():
        print(f"error: no model at {args.smollm2_dir}: write it with scripts/smollm2_fp32.py", file=sys.stderr)
        return 2
    flags = ["--config", str(CHECKOUT / "peers/configs/cpu.toml"), "--model", str(args.smollm2_dir),
             "--dataset", str(CORPUS), "--seq-len", str(args.seq_len), "--inner-steps", str(args.inner_steps),
             "--threads", "1"]  # fmt: skip
    runs = args.out / "runs"
    shutil.rmtree(runs, ignore_errors=True)  # fresh work dirs: no checkpoint is resumed
    report = run_swarm(runs, flags, args.units, args.train_s, args.timeout_s)
    report.update(command=" ".join([Path(sys.executable).name, *sys.argv]), flags=flags, train_s=args.train_s,
                  environment=f"Python {platform.python_version()}, torch {torch.__version__}, "
                  f"{os.cpu_count()} CPUs")  # fmt: skip
    (args.out / "exit_memory.json").write_text(json.dumps(report, indent=1) + "\n")
    table = markdown(report)
    (args.out / "exit_memory.md").write_text(table + "\n")
    plot(report, args.out / "exit_memory.png")
    print(table)
    return 0 if all(passed(unit) for unit in report["units"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
