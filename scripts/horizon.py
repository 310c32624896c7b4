#!/usr/bin/env python
"""Quality at a long horizon, in the shape of the DiLoCo scaling-laws paper's Table 4 (bench/horizon.py): data-parallel
on a global batch, synchronous DiLoCo with M units sharing it, and ours-async, trained to --tokens-per-param, once per
seed, --jobs methods at a time.

    .venv/bin/python scripts/horizon.py --out results/quality/horizon/l2-d32 --model-config bench/models/gpt2-l2-d32 \\
        --set data__dataset=corpora/shakespeare --units 1 2 4 8 --async-units 4 --seeds 0 1 2 --jobs 2
    .venv/bin/python scripts/horizon.py --merge DIR... --out DIR     # one report of runs at the same horizon

Writes horizon.json, horizon.md and horizon.png to --out (a folder holding a report already gets the new rows merged
into it). ``--outer-sets`` runs every DiLoCo method once per set of [outer] overrides (a sweep of the outer step).
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the laboratory, bench/, lives in the checkout

from bench.horizon import Horizon, SeededResult, run_seeds  # noqa: E402
from bench.horizon_report import REPORT, document, merge, write_report  # noqa: E402
from bench.quality import MEASURED_DELAY_STEPS, Method, add_method_arguments, diloco_methods  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="results folder")
    parser.add_argument("--merge", type=Path, nargs="+", help="only merge these runs' reports into --out")
    parser.add_argument("--model-config", help="the model's config folder (default: the tiny preset's model)")
    parser.add_argument("--tokens-per-param", type=float, default=20.0, help="0: --rounds alone sets the budget")
    parser.add_argument("--rounds", type=int, default=0, help="at least this many rounds (a fine-tune's budget)")
    parser.add_argument("--global-batch", type=int, default=16, help="sequences per inner step over all units")
    parser.add_argument("--inner-steps", type=int, default=16, help="H")
    add_method_arguments(parser)
    parser.add_argument(
        "--delay-fraction",
        type=float,
        default=MEASURED_DELAY_STEPS / 20,
        help="ours-async: inner steps a round is in flight, as a fraction of H (measured: 8 of 20)",
    )
    parser.add_argument("--no-data-parallel", action="store_true", help="leave data-parallel out (run elsewhere)")
    parser.add_argument(
        "--data-parallel-streams", type=int, nargs="*", default=[], metavar="M",
        help="also data-parallel whose step takes its global batch from M units' own document orders, as M DiLoCo "
        "units read them (a check that the data order is not what DiLoCo loses on)",
    )  # fmt: skip
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--jobs", type=int, default=2, help="methods trained at once (one CPU thread each)")
    parser.add_argument("--evals", type=int, default=16, help="eval points per method")
    parser.add_argument("--eval-rows", type=int, default=128, help="held-out sequences of every evaluation")
    return parser


def methods(args: argparse.Namespace, horizon: Horizon) -> list[Method]:
    chosen = [] if args.no_data_parallel else [horizon.method("data-parallel", "data-parallel", 1)]
    chosen += [horizon.method(f"data-parallel-{m}-streams", "data-parallel", m) for m in args.data_parallel_streams]
    delay = round(args.delay_fraction * args.inner_steps)
    return chosen + diloco_methods(args.units, args.async_units, args.outer_sets, dict(args.outer), args.alone_p,
                                   delay, make=horizon.method)  # fmt: skip


def _print(done: SeededResult) -> None:
    result = done.result
    print(f"{result.method.name} seed {done.seed}: eval loss {result.final_loss:.4f} after {result.tokens:,} tokens, "
          f"{result.rounds} rounds, {result.seconds:.0f} s", flush=True)  # fmt: skip


def main() -> int:
    args = _parser().parse_args()
    if args.merge:
        write_report(merge([json.loads((folder / REPORT).read_text()) for folder in args.merge]), args.out)
        print((args.out / "horizon.md").read_text())
        return 0
    settings = dict(args.set)
    if args.model_config:
        settings.setdefault("model__model_config", args.model_config)
        settings.setdefault("model__tokenizer", "p2p_diloco/assets/tiny-gpt2")  # run from the checkout
    command = shlex.join([Path(sys.executable).name, *sys.argv])
    environment = f"{platform.node()}: {platform.processor() or platform.machine()}, Python {platform.python_version()}"
    try:
        horizon = Horizon(args.tokens_per_param, args.global_batch, args.inner_steps, args.evals, args.eval_rows,
                          args.rounds, settings)  # fmt: skip
        parameters, results = run_seeds(methods(args, horizon), horizon, args.seeds, args.jobs, report=_print)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    new = document(results, horizon, parameters, command, environment)
    earlier = args.out / REPORT
    try:
        write_report(merge([json.loads(earlier.read_text()), new]) if earlier.exists() else new, args.out)
    except ValueError as error:  # this run's results are kept whatever the earlier report holds
        kept = args.out / "horizon-unmerged.json"
        kept.write_text(json.dumps(new, indent=1) + "\n")
        print(f"error: {error}; this run's report is in {kept}", file=sys.stderr)
        return 2
    print((args.out / "horizon.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
