#!/usr/bin/env python
"""The prepared device check (bench/device_check.py): two units train the SmolLM2-135M architecture in bf16 autocast
on one GPU; tokens/s, peak device memory per parameter and merged outer rounds.

    python scripts/device_check.py --out $OUT            # on a lent GPU (under 5 minutes; see docs/units.md)
    .venv/bin/python scripts/device_check.py --out /tmp/check --device cpu --model-config p2p_diloco/assets/tiny-gpt2 \
        --steps 60 --seq-len 64 --batch-size 4             # the same check on this machine's CPU, with the tiny model

Exit status 0 when both units exited 0 and merged rounds with each other, else 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the laboratory, bench/, lives in the checkout

from bench.device_check import SMOLLM2_CONFIG, passed, run_check, write_report  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--model-config", type=Path, default=SMOLLM2_CONFIG)
    parser.add_argument("--steps", type=int, default=300, help="inner steps per unit (a round about every 20)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = run_check(args.out, args.steps, args.device, args.model_config, args.seq_len, args.batch_size)
    write_report(args.out, results, [sys.executable, *sys.argv], args.device)
    print((args.out / "device_check.md").read_text())
    return 0 if passed(results) else 1


if __name__ == "__main__":
    sys.exit(main())
