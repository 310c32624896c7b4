"""The rendezvous node of the synchronous baselines: a c10d TCPStore server, as torchrun's c10d rendezvous runs.

``python -m bench.chaos.rendezvous --host H --port P`` serves the store on port P until SIGTERM or SIGINT, then
exits 0. It prints ``rendezvous store ready on H:P`` once clients can connect. Ranks use it only to find each other
when a job (re)starts, so running ranks keep training while it is down; a restarted server starts empty (every
incarnation of a job uses its own key prefix).
"""

from __future__ import annotations

import argparse
import signal
from datetime import timedelta

from torch.distributed import TCPStore


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", required=True, help="the address clients connect to (printed; the server binds all)")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    stop_signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)  # before the store starts its threads: they inherit it
    store = TCPStore(args.host, args.port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    print(f"rendezvous store ready on {args.host}:{args.port}", flush=True)
    signal.sigwait(stop_signals)
    del store
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
