"""Mismatches made visible: units a learning unit never meets, and why.

Two causes are silent otherwise. Units of the unit's run whose records say another model or other round settings
never meet it in a round (plan.py ``KeySchema``): the census names them, with the settings that differ, each time who
differs changes. A run id other than the one the other units use (a typo) trains alone forever: after
``ALONE_ROUNDS`` merged rounds in a row alone, the unit reads the directory of open runs (records.py ``RUNS_KEY``,
which every unit of an open run writes now and then) and names the runs that have units training, again every
``REREAD_ROUNDS`` rounds alone when that list changed. It only logs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from p2p_diloco.network.dht import shared_time
from p2p_diloco.network.records import PeerProgress, PendingRead, ProgressRecords, RunListing

logger = logging.getLogger(__name__)

ALONE_ROUNDS = 3
REREAD_ROUNDS = 20
LISTING_EVERY_S = 120.0
LISTING_TTL_S = 600.0


def settings_differences(mine: str, theirs: str) -> list[str]:
    """``name=theirs (here: mine)`` for every setting of ``theirs`` that differs from ``mine`` (``name=value;...``)."""
    own = dict(item.split("=", 1) for item in mine.split(";") if "=" in item)
    other = dict(item.split("=", 1) for item in theirs.split(";") if "=" in item)
    return [f"{name}={other.get(name, '?')} (here: {own.get(name, '?')})"
            for name in sorted(own.keys() | other.keys()) if own.get(name) != other.get(name)]  # fmt: skip


def strangers(census: Mapping[str, PeerProgress], peer_id: str, fingerprint: str, settings: str) -> dict[str, str]:
    """The units of the census that never meet this one in a round, each with why (another model, other round
    settings); records of older units that publish no settings are not judged on them."""
    why: dict[str, str] = {}
    for other, record in census.items():
        if other == peer_id:
            continue
        if record.model_fingerprint != fingerprint:
            why[other] = f"model {record.model_fingerprint} (here: {fingerprint})"
        elif record.round_settings and record.round_settings != settings:
            why[other] = ", ".join(settings_differences(settings, record.round_settings))
    return why


class MismatchWatch:
    """One unit's watch (see the module docstring) over its ``records``: feed it the census, each merged round's
    group size and every step (:meth:`poll`, which never blocks)."""

    def __init__(self, records: ProgressRecords, run_id: str, peer_id: str, fingerprint: str, settings: str):
        self.records, self.run_id, self.peer_id = records, run_id, peer_id
        self.fingerprint, self.settings = fingerprint, settings
        self.alone_rounds = 0
        self._told_strangers: dict[str, str] = {}
        self._told_runs: frozenset[str] | None = None
        self._runs_read: PendingRead[dict[str, RunListing]] | None = None
        self._listed = -LISTING_EVERY_S

    def census(self, live: Mapping[str, PeerProgress]) -> None:
        """Name the units of the run that never meet this one, when that changed."""
        found = strangers(live, self.peer_id, self.fingerprint, self.settings)
        if found and found != self._told_strangers:
            named = "; ".join(f"{peer[:12]}…: {why}" for peer, why in sorted(found.items()))
            logger.warning("%d unit(s) of run %s never average with this one: %s", len(found), self.run_id, named)
        self._told_strangers = found

    def round_merged(self, group_size: int) -> None:
        """Count the rounds alone in a row; read the directory of runs after ALONE_ROUNDS of them (and again every
        REREAD_ROUNDS)."""
        self.alone_rounds = self.alone_rounds + 1 if group_size <= 1 else 0
        streak = self.alone_rounds - ALONE_ROUNDS
        if streak >= 0 and streak % REREAD_ROUNDS == 0 and self._runs_read is None:
            self._runs_read = self.records.read_runs_soon()

    def poll(self) -> None:
        """List this run in the directory now and then; act on a finished read of the directory."""
        if time.monotonic() - self._listed >= LISTING_EVERY_S:
            self.records.list_run(ttl_s=LISTING_TTL_S)
            self._listed = time.monotonic()
        if self._runs_read is not None and (runs := self._runs_read.poll()) is not None:
            self._runs_read = None
            self._tell_runs(runs)

    def _tell_runs(self, runs: Mapping[str, RunListing]) -> None:
        now = shared_time()
        others = {run_id: listing for run_id, listing in runs.items() if run_id != self.run_id}
        if frozenset(others) == self._told_runs:
            return
        self._told_runs = frozenset(others)
        if not others:
            logger.info("trained alone for %d rounds in run %s; no other open run lists a unit training",
                        self.alone_rounds, self.run_id)  # fmt: skip
            return
        named = ", ".join(f"{run_id!r} (listed {max(0.0, now - listing.last_seen):.0f} s ago)"
                          for run_id, listing in sorted(others.items()))  # fmt: skip
        logger.warning("trained alone for %d rounds in run %r while other runs have units training: %s; check "
                       "--run-id", self.alone_rounds, self.run_id, named)  # fmt: skip
