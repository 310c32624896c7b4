#!/usr/bin/env python
"""Round cost of units behind a firewall (in client mode, or reached through a relay) against reachable ones, two units
behind rate-limited links in network namespaces (root, iproute2, tc and iptables):

    .venv/bin/python scripts/reachability.py --out results/reachability --rounds 6 --repeats 2 --rate-mbit 20

Writes results.json, results.md and rounds.png to --out; bad input prints one ``error:`` line and exits 2.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the laboratory, bench/, lives in the checkout

from bench.chaos.namespaces import NamespaceError  # noqa: E402
from bench.reachability import ARMS, UNIT_FLAGS, run_arm, write_results  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/reachability-run"), help="results folder")
    parser.add_argument("--rounds", type=int, default=8, help="paired rounds measured per unit and swarm (default 8)")
    parser.add_argument("--repeats", type=int, default=2, help="swarms per arm, arms alternating (default 2)")
    parser.add_argument("--rate-mbit", type=float, default=20.0, help="every node's link, each way (default 20)")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="give up a swarm after this long (default 300)")
    return parser


def main() -> int:
    args = _parser().parse_args()
    if args.rounds < 1 or args.repeats < 1 or not args.rate_mbit > 0 or not args.timeout_s > 0:
        print("error: --rounds and --repeats must be at least 1, --rate-mbit and --timeout-s positive", file=sys.stderr)
        return 2
    results = []
    try:
        for repeat in range(args.repeats):
            for arm in ARMS:
                with tempfile.TemporaryDirectory(prefix=f"reach-{arm.replace(' ', '-')}-") as root:
                    results += run_arm(arm, repeat, Path(root), args.rounds, args.rate_mbit, args.timeout_s)
                print(f"repeat {repeat} {arm}: done", flush=True)
    except NamespaceError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    setup = {"model": "the tiny preset's (fp32 rounds)", "rate_mbit": args.rate_mbit, "rounds": args.rounds,
             "repeats": args.repeats, "unit_flags": list(UNIT_FLAGS)}  # fmt: skip
    write_results(args.out, results, setup)
    print((args.out / "results.md").read_text(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
