"""``status``: join the swarm as a DHT client and show every peer's last reported progress, once or live, as a table or
as JSON; :class:`SwarmView` and :func:`swarm_snapshot` are what the dashboard (dashboard.py) reads too.

Everything shown comes from the run's signed progress records in the DHT (records.py): there is no central store.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Literal, TextIO

from p2p_diloco.config import ConfigError, NetworkSection
from p2p_diloco.consensus import SwarmConsensus, swarm_consensus
from p2p_diloco.network.dht import shared_time, start_dht, stop_dht
from p2p_diloco.network.members import believed_rounds
from p2p_diloco.network.membership import load_run_access
from p2p_diloco.network.records import PeerProgress, SwarmRecords, record_validators
from p2p_diloco.network.relays import CLIENT

STALE_AFTER_S = 60.0  # a peer silent for longer is shown as stale (it publishes every few seconds)
EMPTY_REREAD_S = 10.0  # how long a one-shot status reads again before it says no peer reported
PeerState = Literal["live", "stale", "left", "refused"]
_HEADER = ("peer", "inner step", "outer round", "tokens/s", "loss", "eval loss", "last seen", "group size", "goodput")
_CLEAR_SCREEN = "\x1b[H\x1b[2J"


class SwarmView:
    """A client-mode DHT node of ``network.run_id`` that reads the run's progress records; close it when done.

    Joins with a fresh, throw-away identity (never ``network.identity_path``: that one may belong to a live peer). With
    ``network.admission`` (any member's), only the private run's members are read. Raises ConfigError without initial
    peers and NetworkError when the swarm cannot be reached.
    """

    def __init__(self, network: NetworkSection):
        if not network.initial_peers:
            raise ConfigError("needs --initial-peers (a multiaddr of any live swarm member)")
        self.run_id = network.run_id
        access = load_run_access(network.run_id, network.admission, peer_id=None)
        validators = record_validators(access)
        self._dht = start_dht(network.model_copy(update={"identity_path": None}), record_validators=validators,
                              reachability=CLIENT)  # fmt: skip
        self._records = SwarmRecords(self._dht, access, validators)

    def read(self) -> list[PeerProgress]:
        """The unexpired, well-formed progress records, one per peer (empty when the read failed)."""
        return list(self._records.read_progress().values())

    def close(self) -> None:
        stop_dht(self._dht)


def peer_state(row: PeerProgress, now: float, stale_after_s: float = STALE_AFTER_S) -> PeerState:
    """ "left" for a peer that announced it left, "stale" for one silent for over ``stale_after_s``, else "live"."""
    if row.phase == "left":
        return "left"
    return "stale" if _age_s(row, now) > stale_after_s else "live"


def peer_states(rows: list[PeerProgress], now: float, stale_after_s: float = STALE_AFTER_S) -> dict[str, PeerState]:
    """Each peer's :func:`peer_state`, or "refused" for one that has not left whose outer round is far ahead of the
    other peers' (members.believed_rounds): units take neither its round nor its state."""
    states = {row.peer_id: peer_state(row, now, stale_after_s) for row in rows}
    claims = {row.peer_id: row.outer_round for row in rows if states[row.peer_id] != "left"}
    believed = believed_rounds(claims)
    return {peer: "refused" if peer in claims and peer not in believed else state for peer, state in states.items()}


def swarm_snapshot(run_id: str, rows: list[PeerProgress], now: float, stale_after_s: float = STALE_AFTER_S) -> dict:
    """One JSON-ready object: every peer (its record, its state and age, sorted by peer id) and the swarm's totals
    over the live peers (summed tokens/s, goodput as summed useful compute / summed allocated peer-time, mean eval
    loss of those that reported one, consensus distance and lineages of their model probes: consensus.py)."""
    states = peer_states(rows, now, stale_after_s)
    peers = [{**row.dict(exclude={"admission"}), "state": states[row.peer_id], "age_s": round(_age_s(row, now), 1)}
             for row in sorted(rows, key=lambda item: item.peer_id)]  # fmt: skip
    live = [row for row in rows if states[row.peer_id] == "live"]
    allocated = sum(row.allocated_s for row in live)
    evals = [row.eval_loss for row in live if row.eval_loss is not None]
    consensus = swarm_consensus([row.probe for row in live])
    swarm = {
        "live_peers": len(live),
        "peers": len(rows),
        "tokens_per_s": sum(row.tokens_per_s for row in live),
        "goodput": sum(row.useful_compute_s for row in live) / allocated if allocated > 0 else None,
        "eval_loss": sum(evals) / len(evals) if evals else None,
        "max_outer_round": max((row.outer_round for row in live), default=None),
        "mean_group_size": sum(row.group_size for row in live) / len(live) if live else None,
        "consensus_distance": consensus.distance if consensus.units else None,
        "lineages": consensus.lineages if consensus.units else None,
    }
    return {"run_id": run_id, "time": now, "peers": peers, "swarm": swarm}


def run_status(
    network: NetworkSection,
    stale_after_s: float = STALE_AFTER_S,
    as_json: bool = False,
    watch_s: float | None = None,
    stop: threading.Event | None = None,
    out: TextIO | None = None,
) -> int:
    """Show the progress records of ``network.run_id`` on ``out`` (stdout): a table, or with ``as_json`` one JSON
    object (:func:`swarm_snapshot`). Once: return 0, or 1 with a one-line message on stderr when no peer reported
    (read again for up to EMPTY_REREAD_S first: under load a fresh client's first read came back empty while the run's
    records were there, tests/test_red_team.py).
    With ``watch_s``: again every ``watch_s`` seconds until ``stop`` is set (the table redrawn in place on a terminal;
    JSON as one object per line), then return 0. Raises as :class:`SwarmView`."""
    out = out or sys.stdout
    view = SwarmView(network)
    try:
        if watch_s is None:
            rows = view.read()
            deadline = time.monotonic() + EMPTY_REREAD_S
            while not rows and time.monotonic() < deadline:  # a client's first get can miss records that exist
                time.sleep(1.0)
                rows = view.read()
            if not rows:
                print(f"error: no peer of run '{network.run_id}' has reported progress", file=sys.stderr)
                return 1
            print(_render(network.run_id, rows, stale_after_s, as_json), file=out)
            return 0
        stop = stop or threading.Event()
        redraw = not as_json and out.isatty()
        while not stop.is_set():
            rows = view.read()
            text = _render(network.run_id, rows, stale_after_s, as_json) if rows else "no peer has reported progress"
            print((_CLEAR_SCREEN if redraw else "") + text + ("" if redraw or as_json else "\n"), file=out, flush=True)
            stop.wait(watch_s)
        return 0
    finally:
        view.close()


def _render(run_id: str, rows: list[PeerProgress], stale_after_s: float, as_json: bool) -> str:
    now = shared_time()
    if as_json:
        return json.dumps(swarm_snapshot(run_id, rows, now, stale_after_s))
    return format_table(rows, now, stale_after_s)


def format_table(rows: list[PeerProgress], now: float, stale_after_s: float) -> str:
    """Aligned text table, one line per peer sorted by peer id, then the swarm's goodput over the live rows (neither
    stale, left nor refused: their summed useful compute / summed allocated peer-time) and their consensus."""
    lines = [_HEADER]
    states = peer_states(rows, now, stale_after_s)
    for row in sorted(rows, key=lambda item: item.peer_id):
        state = states[row.peer_id]
        lines.append(
            (
                row.peer_id,
                str(row.inner_step),
                str(row.outer_round),
                f"{row.tokens_per_s:.1f}",
                f"{row.loss:.4f}",
                "n/a" if row.eval_loss is None else f"{row.eval_loss:.4f}",
                f"{_age_s(row, now):.0f} s ago" + ("" if state == "live" else f" ({state})"),
                str(row.group_size),
                _percent(row.useful_compute_s, row.allocated_s),
            )
        )
    widths = [max(len(line[column]) for line in lines) for column in range(len(_HEADER))]
    table = "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines)
    live = [row for row in rows if states[row.peer_id] == "live"]
    swarm = _percent(sum(row.useful_compute_s for row in live), sum(row.allocated_s for row in live))
    goodput = f"swarm goodput: {swarm} over {len(live)} live peers (useful compute / allocated peer-time)"
    return f"{table}\n{goodput}\n{consensus_line(swarm_consensus([row.probe for row in live]))}"


def consensus_line(consensus: SwarmConsensus) -> str:
    """How many models the live peers hold and how far apart (consensus.py), for a person."""
    if not consensus.units:
        return "swarm consensus: n/a (no live peer reports a model probe)"
    return f"swarm consensus: {consensus.described('live peers')}"


def _age_s(row: PeerProgress, now: float) -> float:
    return max(0.0, now - row.last_seen)


def _percent(useful_s: float, allocated_s: float) -> str:
    """``useful_s / allocated_s`` as a percentage with one decimal, or ``n/a`` when nothing is allocated."""
    return f"{100 * useful_s / allocated_s:.1f}%" if allocated_s > 0 else "n/a"
