"""Bootstrap node: a long-lived DHT server with a stable identity that only helps peers find each other."""

from __future__ import annotations

import logging
import sys
import threading

from p2p_diloco.config import NetworkSection
from p2p_diloco.lifecycle import install_stop_signals, start_orphan_reaper
from p2p_diloco.network.dht import (
    NetworkError,
    count_routing_peers,
    peer_identity,
    start_dht,
    stop_dht,
    visible_multiaddrs,
)
from p2p_diloco.network.membership import load_run_access
from p2p_diloco.network.reachability import serve_dial_back_checks
from p2p_diloco.network.records import record_validators

logger = logging.getLogger(__name__)

DEFAULT_IDENTITY_PATH = "bootstrap.key"


def run_bootstrap(network: NetworkSection, stop: threading.Event | None = None, report_every_s: float = 10) -> int:
    """Serve the DHT until ``stop`` is set (default: the first SIGINT/SIGTERM); return the exit code.

    Uses ``network.identity_path`` (default ``./bootstrap.key``, created on first run) so the printed multiaddrs stay
    valid across restarts; with ``network.admission`` (its identity's, in a private run) it refuses to store records of
    non-members. Prints one ``initial peers: <maddr>`` line per address, logs the peer count every
    ``report_every_s`` seconds. Returns 0 after a requested stop (DHT and p2pd shut down), 1 with a one-line message
    on stderr if the DHT dies; raises NetworkError if it cannot start.
    """
    if network.reachability == "private":
        raise NetworkError("a bootstrap node must be reachable by every peer: --reachability private is for units")
    start_orphan_reaper()
    stop = stop if stop is not None else install_stop_signals()
    if network.identity_path is None:
        network = network.model_copy(update={"identity_path": DEFAULT_IDENTITY_PATH})
    identity = peer_identity(network.identity_path)
    access = load_run_access(network.run_id, network.admission, identity.peer_id)
    dht = start_dht(network, identity=identity, record_validators=record_validators(access, identity.key))
    try:
        dht.run_coroutine(serve_dial_back_checks)
        for maddr in visible_multiaddrs(dht):
            print(f"initial peers: {maddr}", flush=True)
        logger.info(
            "bootstrap ready run_id=%s peer_id=%s identity=%s", network.run_id, dht.peer_id, network.identity_path
        )
        while not stop.wait(report_every_s):
            if not dht.is_alive():
                print("error: the DHT process died", file=sys.stderr)
                return 1
            logger.info("bootstrap alive routing_peers=%d", count_routing_peers(dht))
        logger.info("bootstrap stopping")
        return 0
    finally:
        stop_dht(dht)
