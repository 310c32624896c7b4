#!/usr/bin/env python
"""A real fine-tune across N learning units on 127.0.0.1 (separate processes, hivemind; bench/swarm.py): every
unit's held-out eval loss of its consensus model φ when it joined, at each eval and when it left, against the
pretrained start (the first unit's eval at its join).

    .venv/bin/python scripts/finetune.py --out /tmp/ft --model /path/to/smollm2 --dataset /path/to/texts \\
        --max-steps 40 --flags "--seq-len 128 --batch-size 4 --inner-lr 1e-4 --warmup-steps 10 --inner-steps 5"

With ``--late-join-after-rounds K`` the last unit starts only once the first has merged K rounds (it downloads the
swarm's state); with ``--restart-after-rounds K`` the last unit is killed (SIGKILL, its whole process tree) once it
merged K rounds, and started again on its work dir (it resumes from its checkpoint). Each unit trains --max-steps
inner steps in all, across a restart.

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
from p2p_diloco.unit.events import Eval  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="results folder (the units' work dirs go under it)")
    parser.add_argument("--units", type=int, default=2)
    parser.add_argument("--model", required=True, help="pretrained model: hub name or local folder")
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--eval-dataset", default=None)
    parser.add_argument("--max-steps", type=int, required=True, help="inner steps of every unit")
    parser.add_argument("--flags", default="", help="more `p2p-diloco join` flags for every unit (one string)")
    parser.add_argument(
        "--late-join-after-rounds",
        type=int,
        default=0,
        help="start the last unit after the first merged this many rounds (0: all start together)",
    )
    parser.add_argument(
        "--restart-after-rounds",
        type=int,
        default=0,
        help="SIGKILL the last unit after it merged this many rounds, then start it again (0: no restart)",
    )
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
        first, last = names[0], names[-1]
        for name in names[:-1] if args.late_join_after_rounds else names:
            swarm.unit(name, [maddr], duration_s=args.timeout_s)
        if args.late_join_after_rounds:
            _wait_for_rounds(swarm, first, args.late_join_after_rounds, args.timeout_s)
            swarm.unit(last, [maddr], duration_s=args.timeout_s)
        if args.restart_after_rounds:
            _wait_for_rounds(swarm, last, args.restart_after_rounds, args.timeout_s)
            swarm.kill_tree(last)
            swarm.unit(last, [maddr], duration_s=args.timeout_s)
        swarm.wait_for(lambda: not any(swarm.running(name) for name in names), args.timeout_s, "every unit to finish")
        first_evals = _evals(swarm, first)
        start_loss = first_evals[0].eval_loss if first_evals else None
        rows = [_row(swarm, name, start_loss) for name in names]
    finally:
        swarm.close()
    document = {"command": shlex.join([Path(sys.executable).name, *sys.argv]), "seconds": time.monotonic() - started,
                "pretrained_loss": start_loss, "units": rows}  # fmt: skip
    (args.out / "finetune.json").write_text(json.dumps(document, indent=1) + "\n")
    (args.out / "finetune.md").write_text(_markdown(document))
    print(_markdown(document))
    return 0


def _wait_for_rounds(swarm: Swarm, name: str, rounds: int, timeout_s: float) -> None:
    swarm.wait_for(lambda: len(swarm.rounds(name)) >= rounds or None, timeout_s, f"{name} to merge {rounds} rounds")


def _evals(swarm: Swarm, name: str) -> list[Eval]:
    return [event for event in swarm.events(name, Eval) if event.eval_loss is not None]


def _row(swarm: Swarm, name: str, pretrained_loss: float | None) -> dict:
    evals = _evals(swarm, name)
    rounds = swarm.rounds(name)
    losses = [event.eval_loss for event in evals if event.eval_loss is not None]
    return {
        "unit": name,
        "joins": sum(event.reason == "join" for event in evals),
        "start_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "highest_loss": max(losses) if losses else None,
        "above_pretrained": sum(loss > pretrained_loss for loss in losses) if pretrained_loss is not None else None,
        "evals": [(event.reason, event.outer_round, event.eval_loss) for event in evals],
        "rounds": len(rounds),
        "mean_group": sum(r.group_size for r in rounds) / len(rounds) if rounds else 0.0,
    }


def _markdown(document: dict) -> str:
    pretrained = document["pretrained_loss"]
    lines = ["# Fine-tune across real units", "", "    " + document["command"], "",
             f"{document['seconds']:.0f} s in all. Pretrained start (the first unit's eval at its join): "
             f"{pretrained:.4f}." if pretrained is not None else "No eval of the pretrained start.", "",
             "| unit | joins | held-out loss at its first join | at the end | end vs pretrained | highest "
             "| evals above the pretrained start | rounds | mean group |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in document["units"]:
        start, final = row["start_loss"], row["final_loss"]
        if start is None or final is None or pretrained is None:
            lines.append(f"| {row['unit']} | {row['joins']} | n/a | n/a | n/a | n/a | n/a | {row['rounds']} "
                         f"| {row['mean_group']:.2f} |")  # fmt: skip
            continue
        change = 100 * (final - pretrained) / pretrained
        lines.append(f"| {row['unit']} | {row['joins']} | {start:.4f} | {final:.4f} | {change:+.2f}% "
                     f"| {row['highest_loss']:.4f} | {row['above_pretrained']} of {len(row['evals'])} "
                     f"| {row['rounds']} | {row['mean_group']:.2f} |")  # fmt: skip
    lines += ["", "Evals (reason, outer round, loss):", ""]
    lines += [f"- {row['unit']}: " + ", ".join(f"{reason} r{rnd} {loss:.4f}" for reason, rnd, loss in row["evals"])
              for row in document["units"]]  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
