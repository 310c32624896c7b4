"""Where a learning unit's state comes from when it joins (the join rule), and the pieces of a join.

Join rule: if live peers report a later outer round than this unit's local checkpoint (or it has none), the unit
downloads φ, the outer momentum and the counters from a live peer and trains from φ; otherwise it resumes its
checkpoint, or starts from the initial weights when the swarm has no state yet. The round a swarm is at is the latest
that its units claim, each by the later of its progress record (published every 10 s) and its donor record (declared
every round: a unit that joined while the progress records still said round 0 trained from the initial weights). A
round claimed far ahead of the others' is not believed (members.py ``believed_rounds``). A unit that left (its last
record, which outlives it for minutes) serves nothing and claims nothing. Donor records count alone only when another
unit claimed the run's model before this one and no progress record is readable for a while (``swarm_round_seen``):
otherwise identities that publish nothing but donor records could lure a joiner (red team ``donor-flood``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from p2p_diloco.checkpoint import load_checkpoint
from p2p_diloco.errors import UserError
from p2p_diloco.network.members import believed_rounds
from p2p_diloco.network.records import PeerProgress
from p2p_diloco.network.state_sync import StateService, SwarmState
from p2p_diloco.trust import STATE_LOSS_RATIO
from p2p_diloco.unit import events
from p2p_diloco.unit.data import DataPosition, TextData

logger = logging.getLogger(__name__)

SEEN_WAIT_S = 30.0
"""How long a joiner that knows a unit joined before it rereads records it cannot read (progress records are
published every 10 s and live 30 s; donor records are declared every round)."""
SEEN_RETRY_S = 2.0


class JoinError(UserError):
    """The unit cannot take part in this swarm; the message is one line for the user."""


class StatesRefused(JoinError):
    """No believable state was served in time, and the states of ``donors`` were refused."""

    def __init__(self, message: str, donors: frozenset[str]):
        super().__init__(message)
        self.donors = donors


def own_checkpoint(path: Path, fingerprint: str) -> dict[str, Any] | None:
    """The unit's checkpoint at ``path`` (None: none). Raises JoinError for a checkpoint of another model,
    CheckpointError for an unreadable one."""
    checkpoint = load_checkpoint(path)
    if checkpoint is not None and checkpoint.get("model_fingerprint") != fingerprint:
        raise JoinError(f"{path} holds a checkpoint of another model; use another --work-dir")
    return checkpoint


def swarm_round(records: dict[str, PeerProgress], declared: dict[str, int], peer_id: str) -> int:
    """The latest outer round the other units claim and are believed (-1: none). A unit's claim is the later of its
    progress record and its donor record (``declared``, peer → round); a donor record counts only for a unit that
    publishes progress: donor records alone are what a flood of identities that train and serve nothing multiplies
    (red team ``donor-flood``: with them, a unit that started beside a red unit took its state at round 10^6)."""
    claims = {
        peer: max(record.outer_round, declared.get(peer, -1)) for peer, record in records.items() if peer != peer_id
    }
    return max(believed_rounds(claims).values(), default=-1)


def donors_round(declared: dict[str, int]) -> int:
    """The latest round the donor records declare among those believed (-1: none)."""
    return max(believed_rounds(declared).values(), default=-1)


def swarm_round_seen(
    claimed_round: Callable[[], int], donor_round: Callable[[], int], swarm_seen: bool, timeout_s: float
) -> int:
    """The round the swarm claims (``claimed_round()``, -1: none). When nothing is readable but ``swarm_seen`` (a
    unit joined the run before this one), the records are read again every ``SEEN_RETRY_S`` for up to
    ``min(timeout_s, SEEN_WAIT_S)`` (a get that failed; units busy for longer than their progress records live, in a
    long evaluation or checkpoint); if no progress record is readable then, the donor records alone say where the swarm
    is (``donor_round()``: units serving their state from their forked state servers while their training loops are
    busy), with a warning; with none of either, a warning says why the unit starts from the initial weights."""
    claimed = claimed_round()
    if claimed >= 0 or not swarm_seen:
        return claimed
    wait_s = min(timeout_s, SEEN_WAIT_S)
    logger.info("the run's model record was published by another unit, but none of its progress or donor records is "
                "readable: reading them again for up to %.0f s", wait_s)  # fmt: skip
    deadline = time.monotonic() + wait_s
    while claimed < 0 and time.monotonic() < deadline:
        time.sleep(SEEN_RETRY_S)
        claimed = claimed_round()
    if claimed >= 0:
        return claimed
    claimed = donor_round()
    if claimed > 0:
        logger.warning("no unit of this run published progress within %.0f s, but donors declare outer round %d: "
                       "taking their state", wait_s, claimed)  # fmt: skip
    else:
        logger.warning("starting from the initial weights although another unit joined this run before (its model "
                       "record): no progress or donor record of a live unit was readable within %.0f s; if the swarm "
                       "is past round 0, its rounds will pull this unit in", wait_s)  # fmt: skip
    return claimed


def data_position(checkpoint: dict[str, Any] | None, data: TextData | None) -> DataPosition:
    """Where the checkpoint's data stream was, if it was this unit's stream (the same shard seed: the same peer
    identity and seed), whatever state the unit then takes: the data it trained on stays trained on."""
    saved = checkpoint.get("data") if checkpoint is not None else None
    if data is None or not isinstance(saved, dict) or saved.get("shard_seed") != data.shard_seed:
        return DataPosition()
    try:
        position = DataPosition.from_dict({key: saved.get(key) for key in ("epoch", "documents")})
    except ValueError as error:
        logger.warning("the checkpoint's data position is unreadable, the data starts afresh: %s", error)
        return DataPosition()
    logger.info("data resumes at epoch %d after %d documents", position.epoch, position.documents)
    return position


def download_state(
    server: StateService,
    swarm_round: int,
    timeout_s: float,
    metrics: events.EventSink,
    refusal: Callable[[SwarmState], str | None] = lambda state: None,
) -> SwarmState:
    """The swarm's state from a live peer, retried until ``timeout_s``; the download is written to ``metrics``. A state
    for which ``refusal`` gives a reason is refused (logged) and its donors are not asked again. Raises JoinError
    (StatesRefused once a state was refused)."""
    started = time.monotonic()
    deadline = started + timeout_s
    refused: frozenset[str] = frozenset()
    while time.monotonic() < deadline:
        state = server.download(timeout_s=max(1.0, deadline - time.monotonic()), refused=refused)
        why = refusal(state) if state is not None else None
        if state is not None and why is not None:
            logger.warning("state of %s refused: %s", " and ".join(state.donors) or "a donor", why)
            refused |= set(state.donors)
            continue
        if state is not None:
            seconds = time.monotonic() - started
            donor = dict(donor_inner_step=state.inner_step, donor_tokens=state.tokens)
            metrics.write(events.StateDownload(seconds=seconds, outer_round=state.outer_round, **donor))
            logger.info("downloaded swarm state: outer_round=%d seconds=%.2f", state.outer_round, seconds)
            return state
        time.sleep(0.5)
    message = f"the swarm is at outer round {swarm_round} but no live peer served its state within {timeout_s:.0f} s"
    if refused:
        raise StatesRefused(f"{message} (states refused: those of {', '.join(sorted(refused))})", refused)
    raise JoinError(message)


def loss_refusal(loss: float, reference: float, what: str) -> str | None:
    """Why a downloaded state whose held-out loss is ``loss`` is not believed (None: believed): a loss over
    STATE_LOSS_RATIO × ``reference`` (trust.py), a state no live unit trains from; ``what`` says what the reference is
    (for the log)."""
    if math.isfinite(loss) and loss <= STATE_LOSS_RATIO * reference:
        return None
    return f"its held-out loss {loss:.4g} is over {STATE_LOSS_RATIO:g} x {what} ({reference:.4g})"
