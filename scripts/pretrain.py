#!/usr/bin/env python
"""Pre-train a model in one process (plain inner loop, no rounds) and export it as a Hugging Face folder: the
pretrained starting point of the fine-tuning comparisons (scripts/quality.py --set model__model=DIR).

    .venv/bin/python scripts/pretrain.py --out /tmp/tiny-shakespeare --tokens 3000000 \\
        --set data__dataset=/path/to/shakespeare/texts --set inner__decay_steps=6000

Settings are the tiny preset's (the embedded model, its tokenizer, the inner optimizer) with ``--set
section__field=value`` over them. Prints the held-out loss before and after.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the laboratory, bench/, lives in the checkout

from bench.quality import Budget, parse_assignment, pretrain  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder of the exported model")
    parser.add_argument("--tokens", type=int, required=True, help="training tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", type=parse_assignment, action="append", default=[], help="section__field=value")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    done = pretrain(Budget(args.tokens, seed=args.seed, settings=dict(args.set)), args.out)
    print(f"{done.steps} steps, {done.tokens:,} tokens, {time.perf_counter() - started:.0f} s: held-out loss "
          f"{done.start_loss:.4f} -> {done.final_loss:.4f}; exported to {done.path}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
