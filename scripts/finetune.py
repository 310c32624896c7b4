#!/usr/bin/env python
"""A real fine-tune across N learning units on 127.0.0.1 (separate processes, hivemind; bench/swarm.py): every
unit's held-out eval loss of its consensus model φ when it joined (the pretrained start) and when it left.

    .venv/bin/python scripts/finetune.py --out /tmp/ft --model /path/to/smollm2 --dataset /path/to/texts \\
        --max-steps 40 --flags "--seq-len 128 --batch-size 4 --inner-lr 1e-4 --warmup-steps 10 --inner-steps 5"

Units start from the tiny preset (the launcher's) with ``--flags`` and the options here over it; each evaluates on
the same held-out documents (``--eval-dataset``, else those its dataset holds out by hash). Writes finetune.json and
finetune.md to --out.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the laboratory, bench/, lives in the checkout

from bench.swarm import Swarm  # noqa: E402
from p2p_diloco.events import Eval  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="results folder (the units' work dirs go under it)")
    parser.add_argument("--units", type=int, default=2)
    parser.add_argument("--model", required=True, help="pretrained model: hub name or local folder")
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--eval-dataset", default=None)
    parser.add_argument("--max-steps", type=int, required=True, help="inner steps of every unit")
    parser.add_argument("--flags", default="", help="more `p2p-diloco join` flags for every unit (one string)")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="give up after this long")
    return parser


def main() -> int:
    args = _parser().parse_args()
    evaluation = ["--eval-dataset", args.eval_dataset] if args.eval_dataset else []
    flags = [*shlex.split(args.flags), "--model", args.model, "--dataset", args.dataset, *evaluation,
             "--max-steps", str(args.max_steps)]  # fmt: skip
    names = [f"unit{index}" for index in range(args.units)]
    swarm = Swarm(args.out / "swarm", run_id="finetune", unit_flags=flags)
    started = time.monotonic()
    try:
        maddr = swarm.bootstrap("bootstrap")
        for name in names:
            swarm.unit(name, [maddr], duration_s=args.timeout_s)
        swarm.wait_for(lambda: not any(swarm.running(name) for name in names), args.timeout_s, "every unit to finish")
        rows = [_row(swarm, name) for name in names]
    finally:
        swarm.close()
    document = {"command": shlex.join([Path(sys.executable).name, *sys.argv]), "seconds": time.monotonic() - started,
                "units": rows}  # fmt: skip
    (args.out / "finetune.json").write_text(json.dumps(document, indent=1) + "\n")
    (args.out / "finetune.md").write_text(_markdown(document))
    print(_markdown(document))
    return 0


def _row(swarm: Swarm, name: str) -> dict:
    evals = [event for event in swarm.events(name, Eval) if event.eval_loss is not None]
    rounds = swarm.rounds(name)
    return {
        "unit": name,
        "start_loss": evals[0].eval_loss if evals else None,
        "final_loss": evals[-1].eval_loss if evals else None,
        "evals": [(event.outer_round, event.eval_loss) for event in evals],
        "rounds": len(rounds),
        "mean_group": sum(r.group_size for r in rounds) / len(rounds) if rounds else 0.0,
    }


def _markdown(document: dict) -> str:
    lines = ["# Fine-tune across real units", "", "    " + document["command"], "",
             f"{document['seconds']:.0f} s in all.", "",
             "| unit | held-out loss at the start | at the end | change | rounds | mean group |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for row in document["units"]:
        start, final = row["start_loss"], row["final_loss"]
        if start is None or final is None:
            lines.append(f"| {row['unit']} | n/a | n/a | n/a | {row['rounds']} | {row['mean_group']:.2f} |")
            continue
        change = 100 * (final - start) / start
        lines.append(f"| {row['unit']} | {start:.4f} | {final:.4f} | {change:+.2f}% | {row['rounds']} "
                     f"| {row['mean_group']:.2f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
