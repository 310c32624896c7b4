"""``p2p-diloco <command>``: parse arguments, call one ``run_*`` function, map errors.

Bad input (config, model, dataset, addresses, an unreachable swarm, a model that does not match the swarm's)
prints one ``error: ...`` line to stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

from p2p_diloco import __version__
from p2p_diloco.config import ConfigError
from p2p_diloco.errors import UserError
from p2p_diloco.settings import add_config_arguments, config_toml, load_config, load_network_section

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _log_level_argument(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default=default, help="default INFO")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="p2p-diloco",
        description="Peer-to-peer, fault-tolerant, low-bandwidth DiLoCo training of Hugging Face language models.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _log_level_argument(parser, default="INFO")
    after_command = argparse.ArgumentParser(add_help=False)  # --log-level after the command wins over one before
    _log_level_argument(after_command, default=argparse.SUPPRESS)
    commands = parser.add_subparsers(dest="command", required=True)
    subcommand = functools.partial(commands.add_parser, allow_abbrev=False, parents=[after_command])

    bootstrap = subcommand("bootstrap", help="run a DHT node that helps peers find each other")
    add_config_arguments(bootstrap, sections=("network",))
    bootstrap.set_defaults(handler=_bootstrap)

    join = subcommand(
        "join", help="join a swarm as one learning unit and train", usage="%(prog)s [--preset NAME] [--config FILE] "
        "[options]", description="Join a swarm as one learning unit and train. Every other setting: --help-all, a "
        "--config TOML file, or a preset.",
    )  # fmt: skip
    add_config_arguments(join, sections=("network", "model", "data", "run", "outer", "inner"), brief=True)
    join.add_argument("--print-config", action="store_true", help="print the resolved configuration as TOML and exit")
    join.set_defaults(handler=_join)

    status = subcommand("status", help="print the swarm as the DHT sees it")
    add_config_arguments(status, sections=("network",))
    status.add_argument("--json", action="store_true", help="one JSON object: every peer and the swarm's totals")
    status.add_argument("--watch", action="store_true", help="read again every --interval seconds until Ctrl+C")
    status.add_argument("--interval", type=_positive_seconds, default=5.0, help="seconds between reads (default 5)")
    status.set_defaults(handler=_status)

    dashboard = subcommand("dashboard", help="serve a live web page of the swarm (read from the DHT alone)")
    add_config_arguments(dashboard, sections=("network",))
    dashboard.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
    dashboard.add_argument("--port", type=int, default=8080, help="port to serve on (default 8080; 0: any free one)")
    dashboard.add_argument("--interval", type=_positive_seconds, default=5.0, help="seconds between DHT reads")
    dashboard.set_defaults(handler=_dashboard)

    export = subcommand("export", help="turn a unit's checkpoint into a Hugging Face model folder")
    export.add_argument("--work-dir", type=Path, required=True, help="the unit's work dir (checkpoint.pt, run.json)")
    export.add_argument("--out", type=Path, required=True, help="model folder to write (replaced atomically)")
    export.add_argument("--adapter-only", action="store_true", help="with LoRA: the adapter alone, not merged")
    export.set_defaults(handler=_export)

    run_key = subcommand("run-key", help="create a private run's key (its owner keeps it)")
    run_key.add_argument("--out", type=Path, required=True, help="key file to create (an existing one is kept)")
    run_key.set_defaults(handler=_run_key)

    identity = subcommand("identity", help="create a peer identity and print its peer id")
    identity.add_argument("--identity-path", type=Path, required=True, help="key file (created if missing)")
    identity.set_defaults(handler=_identity)

    admit = subcommand("admit", help="admit a peer id to a private run")
    admit.add_argument("--run-key", type=Path, required=True, help="the run key file (from run-key)")
    admit.add_argument("--run-id", required=True, help="the run's id")
    admit.add_argument("--peer-id", required=True, help="the peer id to admit (from p2p-diloco identity)")
    admit.add_argument("--out", type=Path, help="admission file to write (default: print it)")
    admit.set_defaults(handler=_admit)

    demo = subcommand("demo", help="bootstrap + several peers on 127.0.0.1 with the embedded model and corpus")
    demo.add_argument("--peers", type=int, default=3, help="learning units to start (default 3)")
    demo.add_argument("--duration", type=float, default=60.0, help="seconds of training per peer (default 60)")
    demo.add_argument(
        "--work-dir", type=Path, default=Path("runs/demo"), help="each run writes a new run-<time> folder here"
    )
    demo.set_defaults(handler=_demo)
    return parser


def _start_logging(args: argparse.Namespace) -> None:
    """Logging to stderr at ``--log-level``; called once the input is validated (it imports hivemind)."""
    from p2p_diloco.unit.metrics import configure_logging

    configure_logging(args.log_level)


def _bootstrap(args: argparse.Namespace) -> int:
    network = load_network_section(args)
    _start_logging(args)
    from p2p_diloco.lifecycle import install_stop_signals
    from p2p_diloco.ops.bootstrap_node import run_bootstrap

    return run_bootstrap(network, stop=install_stop_signals())


def _join(args: argparse.Namespace) -> int:
    config = load_config(args)  # before any heavy import: a typo is reported at once
    if args.print_config:
        print(config_toml(config), end="")
        return 0
    _start_logging(args)
    from p2p_diloco.lifecycle import (
        die_with_launcher,
        ensure_fork_start_method,
        exit_at_once,
        install_stop_signals,
        launched,
        start_orphan_reaper,
    )

    if launched():
        die_with_launcher()  # before the heavy imports: a rank never outlives its launcher
    from p2p_diloco.ops.launcher import launch_ranks
    from p2p_diloco.peer import run_peer

    if config.run.nproc_per_node > 1 and not launched():
        return launch_ranks(config.run.nproc_per_node, config.run.max_restarts, config.model.device, args.argv)
    ensure_fork_start_method()
    start_orphan_reaper()
    run_peer(config, install_stop_signals())
    exit_at_once(0)  # the unit left: every process it started is stopped, its files are closed


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _status(args: argparse.Namespace) -> int:
    network = load_network_section(args)
    _start_logging(args)
    from p2p_diloco.lifecycle import install_stop_signals
    from p2p_diloco.ops.status import run_status

    stop = install_stop_signals() if args.watch else None
    return run_status(network, as_json=args.json, watch_s=args.interval if args.watch else None, stop=stop)


def _dashboard(args: argparse.Namespace) -> int:
    network = load_network_section(args)
    _start_logging(args)
    from p2p_diloco.ops.dashboard import run_dashboard

    return run_dashboard(network, host=args.host, port=args.port, interval_s=args.interval)


def _export(args: argparse.Namespace) -> int:
    _start_logging(args)
    from p2p_diloco.ops.export import run_export

    return run_export(args.work_dir, args.out, adapter_only=args.adapter_only)


def _run_key(args: argparse.Namespace) -> int:
    _start_logging(args)
    from p2p_diloco.ops.credentials import run_make_run_key

    return run_make_run_key(args.out)


def _identity(args: argparse.Namespace) -> int:
    _start_logging(args)
    from p2p_diloco.ops.credentials import run_identity

    return run_identity(args.identity_path)


def _admit(args: argparse.Namespace) -> int:
    from p2p_diloco.ops.credentials import run_admit

    network = load_network_section(argparse.Namespace(**{"network.run_id": args.run_id}))
    _start_logging(args)
    return run_admit(args.run_key, network.run_id, args.peer_id, args.out)


def _demo(args: argparse.Namespace) -> int:
    from p2p_diloco.ops.demo import run_demo

    if args.peers < 1 or args.duration <= 0:
        raise ConfigError("--peers must be >= 1 and --duration > 0")
    _start_logging(args)
    return run_demo(peers=args.peers, duration_s=args.duration, work_dir=args.work_dir)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    args.argv = argv  # the ranks of a unit run the same command
    try:
        return args.handler(args)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a second Ctrl+C: the owned processes were stopped on the way out
        print("aborted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
