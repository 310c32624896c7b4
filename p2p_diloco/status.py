"""``status``: join the swarm as a DHT client and print every peer's last reported progress."""

from __future__ import annotations

import sys

from hivemind.utils import get_dht_time

from p2p_diloco.config import ConfigError, NetworkSection
from p2p_diloco.dht import start_dht, stop_dht
from p2p_diloco.records import PeerProgress, SwarmRecords, record_validators

_HEADER = ("peer", "inner step", "outer round", "tokens/s", "loss", "last seen", "group size")


def run_status(network: NetworkSection, stale_after_s: float = 60) -> int:
    """Print a table of the PeerProgress records of ``network.run_id``; return 0, or 1 with a one-line message on
    stderr when no peer reported. Rows older than ``stale_after_s`` are marked. Raises ConfigError without
    initial peers and NetworkError when the swarm cannot be reached.

    Joins with a fresh, throw-away identity (never ``network.identity_path``: that one may belong to a live peer).
    """
    if not network.initial_peers:
        raise ConfigError("status needs --initial-peers (a multiaddr of any live swarm member)")
    network = network.model_copy(update={"identity_path": None})
    validators = record_validators(network.run_id)
    dht = start_dht(network, record_validators=validators, client_mode=True)
    try:
        progress = SwarmRecords(dht, network.run_id, validators).read_progress()
    finally:
        stop_dht(dht)
    if not progress:
        print(f"error: no peer of run '{network.run_id}' has reported progress", file=sys.stderr)
        return 1
    print(format_table(list(progress.values()), get_dht_time(), stale_after_s))
    return 0


def format_table(rows: list[PeerProgress], now: float, stale_after_s: float) -> str:
    """Aligned text table, one line per peer sorted by peer id."""
    lines = [_HEADER]
    for row in sorted(rows, key=lambda item: item.peer_id):
        age = max(0.0, now - row.last_seen)
        lines.append(
            (
                row.peer_id,
                str(row.inner_step),
                str(row.outer_round),
                f"{row.tokens_per_s:.1f}",
                f"{row.loss:.4f}",
                f"{age:.0f} s ago" + (" (stale)" if age > stale_after_s else ""),
                str(row.group_size),
            )
        )
    widths = [max(len(line[column]) for line in lines) for column in range(len(_HEADER))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines)
