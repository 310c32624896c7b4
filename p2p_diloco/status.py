"""``status``: join the swarm as a DHT client and print every peer's last reported progress."""

from __future__ import annotations

import sys

from hivemind.utils import get_dht_time

from p2p_diloco.config import ConfigError, NetworkSection
from p2p_diloco.dht import start_dht, stop_dht
from p2p_diloco.membership import load_run_access
from p2p_diloco.records import PeerProgress, SwarmRecords, record_validators

_HEADER = ("peer", "inner step", "outer round", "tokens/s", "loss", "last seen", "group size", "goodput")


def run_status(network: NetworkSection, stale_after_s: float = 60) -> int:
    """Print a table of the PeerProgress records of ``network.run_id``; return 0, or 1 with a one-line message on
    stderr when no peer reported. Rows older than ``stale_after_s`` are marked. Raises ConfigError without
    initial peers and NetworkError when the swarm cannot be reached.

    Joins with a fresh, throw-away identity (never ``network.identity_path``: that one may belong to a live peer). With
    ``network.admission`` (any member's), only the private run's members are shown.
    """
    if not network.initial_peers:
        raise ConfigError("status needs --initial-peers (a multiaddr of any live swarm member)")
    access = load_run_access(network.run_id, network.admission, peer_id=None)
    network = network.model_copy(update={"identity_path": None})
    validators = record_validators(access)
    dht = start_dht(network, record_validators=validators, client_mode=True)
    try:
        progress = SwarmRecords(dht, access, validators).read_progress()
    finally:
        stop_dht(dht)
    if not progress:
        print(f"error: no peer of run '{network.run_id}' has reported progress", file=sys.stderr)
        return 1
    print(format_table(list(progress.values()), get_dht_time(), stale_after_s))
    return 0


def format_table(rows: list[PeerProgress], now: float, stale_after_s: float) -> str:
    """Aligned text table, one line per peer sorted by peer id, then the swarm's goodput over the live rows (neither
    stale nor left: their summed useful compute / summed allocated peer-time)."""
    lines = [_HEADER]
    for row in sorted(rows, key=lambda item: item.peer_id):
        lines.append(
            (
                row.peer_id,
                str(row.inner_step),
                str(row.outer_round),
                f"{row.tokens_per_s:.1f}",
                f"{row.loss:.4f}",
                f"{_age_s(row, now):.0f} s ago" + _gone(row, now, stale_after_s),
                str(row.group_size),
                _percent(row.useful_compute_s, row.allocated_s),
            )
        )
    widths = [max(len(line[column]) for line in lines) for column in range(len(_HEADER))]
    table = "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines)
    live = [row for row in rows if not _gone(row, now, stale_after_s)]
    swarm = _percent(sum(row.useful_compute_s for row in live), sum(row.allocated_s for row in live))
    return f"{table}\nswarm goodput: {swarm} over {len(live)} live peers (useful compute / allocated peer-time)"


def _age_s(row: PeerProgress, now: float) -> float:
    return max(0.0, now - row.last_seen)


def _gone(row: PeerProgress, now: float, stale_after_s: float) -> str:
    """ " (left)" for a peer that announced it left, " (stale)" for one silent for over ``stale_after_s``, else ""."""
    if row.phase == "left":
        return " (left)"
    return " (stale)" if _age_s(row, now) > stale_after_s else ""


def _percent(useful_s: float, allocated_s: float) -> str:
    """``useful_s / allocated_s`` as a percentage with one decimal, or ``n/a`` when nothing is allocated."""
    return f"{100 * useful_s / allocated_s:.1f}%" if allocated_s > 0 else "n/a"
