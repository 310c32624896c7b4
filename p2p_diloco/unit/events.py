"""The kinds of event a learning unit writes to its ``metrics.jsonl``, with their fields: the one place that names
them. Writers hand an event to :meth:`p2p_diloco.unit.metrics.MetricsLog.write`; readers get typed events back from
:func:`read_events`, so a renamed field breaks here and at the places that use it, not in string lookups.

On disk an event is one JSON object: ``{"time": unix_seconds, "event": <kind>, ...fields}``; non-finite floats are
written as null (fields that can carry one are typed ``float | None``). Other logs (the laboratory's) define their
own kinds as subclasses of :class:`Event` and read them with the same function.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

E = TypeVar("E", bound="Event")
EvalReason = Literal["join", "outer_round", "final"]
JoinSource = Literal["swarm", "checkpoint", "initial weights"]  # where a unit's state came from


class Event(BaseModel):
    """One line of a metrics log; subclasses set ``event`` (their kind) and declare their fields."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    event: ClassVar[str]  # the "event" key of its JSON line
    time: float = Field(default_factory=time.time)  # unix seconds, when the event was made

    def fields(self) -> dict[str, Any]:
        """The event's own fields (without ``time``)."""
        return self.model_dump(exclude={"time"})


class EventSink(Protocol):
    """What a unit writes its events to (``MetricsLog``, or the fan-out of p2p_diloco/tracking.py); its owner closes
    it."""

    def write(self, event: Event) -> None: ...

    def close(self) -> None: ...


class InnerStep(Event):
    """Every inner step, right after it."""

    event = "inner_step"
    step: int
    loss: float | None
    seconds: float  # compute of the step
    lr: float | None = None  # the inner optimizer's learning rate of the step (None: the caller's own optimizer)
    tokens_per_s: float | None = None  # the unit's averaged throughput, all ranks together


class OuterRoundBegin(Event):
    """A fragment round was handed to its averager; its all-reduce starts at ``scheduled_at`` at the latest."""

    event = "outer_round_begin"
    fragment: int
    outer_round: int
    inner_step: int
    window_s: float  # the matchmaking window
    scheduled_at: float
    weight: int  # tokens since the fragment's last merged round
    period_s: float | None = None  # clock schedule: the unit's round period
    census_units: int | None = None  # clock schedule: the units of the round's layout (rounds/grid.py), this one's
    row: int | None = None  # row of ``rows`` in it, and its place in that row (0: it leads the row's matchmaking)
    rows: int | None = None
    place: int | None = None


class OuterRound(Event):
    """A fragment round merged: with a group (``merged``) or alone (``alone``: quorum 1 and nobody joined)."""

    event = "outer_round"
    status: Literal["merged", "alone"]
    fragment: int
    outer_round: int  # the fragment's round after the merge
    unit_outer_round: int  # the unit's (its smallest fragment round)
    group_size: int
    overlap_steps: int  # inner steps taken while the round was in flight
    seconds: float
    weight: int
    member_drift: float  # relative distance between the members' φ before the round (from their probes)
    useful_compute_s: float  # the unit's cumulative goodput ledger after the merge
    useful_tokens: int
    wire_bytes_sent: int | None = None  # when the unit's round advanced: its p2p daemon's TCP counters
    wire_bytes_received: int | None = None
    goodput: float | None = None  # useful compute over the unit's allocated time, after the merge
    reason: str | None = None  # alone: why no group formed (the averager's error)


class OuterRoundFailed(Event):
    """A fragment round that changed nothing: no usable group (``failed``) or an average that was non-finite or moved φ
    beyond the step bound (``rejected``, ``error`` says which);
    its tokens and compute go into the fragment's next round."""

    event = "outer_round_failed"
    status: Literal["failed", "rejected"]
    fragment: int
    outer_round: int
    error: str | None


class LocalReset(Event):
    """θ became non-finite: it restarted from φ with fresh inner optimizer moments."""

    event = "local_reset"
    outer_round: int
    inner_step: int


class ConsensusBegin(Event):
    event = "consensus_begin"
    fragment: int
    inner_step: int


class ConsensusRound(Event):
    """A consensus round, a mix round (clock schedule) or a settle round (at exit) ended; ``applied`` when its group
    mean moved φ and θ."""

    event = "consensus_round"
    kind: Literal["consensus", "settle", "mix"] = "consensus"
    fragment: int
    group_size: int
    applied: bool
    member_drift: float
    seconds: float
    error: str | None


class ModelProbe(Event):
    """φ at fixed pseudo-random coordinates (the same on every unit of the model), written whenever φ changed: the
    relative distance between two units' probes estimates how far apart their models are."""

    event = "model_probe"
    outer_round: int
    values: list[float]


class SwarmConsensus(Event):
    """After each read of the units' progress records (about every 10 s): how far apart the models of the training
    units are, from the φ probes in their records (p2p_diloco/consensus.py); ``lineages`` 1 is one model."""

    event = "swarm_consensus"
    distance: float
    lineages: int
    units: int


class ReplicaProbe(Event):
    """θ at the probe coordinates on one rank of a unit of several, written by every rank after rank 0 shared a new
    θ (in rank 0's ``metrics.jsonl`` and rank r's ``rank<r>.jsonl``): the ranks' values after the same inner step
    must be equal."""

    event = "replica_probe"
    rank: int
    inner_step: int
    values: list[float]


class Eval(Event):
    """Held-out loss of the unit's φ (the consensus model)."""

    event = "eval"
    reason: EvalReason
    outer_round: int
    eval_loss: float | None


class StateDownload(Event):
    event = "state_download"
    seconds: float
    outer_round: int
    donor_inner_step: int
    donor_tokens: int


class Join(Event):
    event = "join"
    peer_id: str
    ranks: int = 1  # the processes (data-parallel ranks) the unit trains with
    trained_parameters: int = 0  # the scalars the unit trains and averages (the adapters' alone with LoRA)
    source: JoinSource
    outer_round: int
    fingerprint: str
    multiaddrs: str  # space-separated: through which other peers can join


class Stop(Event):
    """The unit left cleanly, after its last rounds, eval and checkpoint."""

    event = "stop"
    inner_step: int
    outer_round: int
    tokens: int
    eval_loss: float | None
    compute_s: float
    useful_compute_s: float
    useful_tokens: int
    allocated_s: float
    goodput: float
    wire_bytes_sent: int | None
    wire_bytes_received: int | None
    peak_device_bytes: int | None = None  # CUDA: the most memory torch allocated on the unit's device; else None


def read_events(path: Path, *kinds: type[E]) -> list[E]:
    """The events of ``kinds`` in the log at ``path``, in file order (other kinds are skipped; a line cut short by a
    kill is skipped); empty if there is no file. Raises ValueError, naming the line, for an event of one of ``kinds``
    whose fields do not match its class."""
    if not path.exists():
        return []
    by_kind: dict[str, type[E]] = {kind.event: kind for kind in kinds}
    events = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        kind = by_kind.get(record.pop("event", None)) if isinstance(record, dict) else None
        if kind is None:
            continue
        try:
            events.append(kind.model_validate(record))
        except ValidationError as error:
            raise ValueError(f"{path}:{number}: not a valid {kind.event!r} event: {error}") from None
    return events
