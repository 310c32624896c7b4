"""In-memory stand-ins for a learning unit's network seams, for tests only (no DHT, no processes, no threads). Each
satisfies the protocol the unit is typed against (the type checker checks it).

* :class:`FakeGroup` / :class:`FakeAverager` (the ``Averager`` protocol, like ``OuterAverager``): a round completes as
  soon as every member of the group has begun it, with the weighted mean of the proposals. What goes wrong is decided
  up front by a :class:`FaultPlan`.
* :class:`FakeStateServer` (``StateService``, like ``StateServer``): publish / download.
* :class:`FakeRecords` (``ProgressRecords``, like ``SwarmRecords``): progress and fingerprint records.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from p2p_diloco.diloco import probe_drift, weighted_average
from p2p_diloco.network.records import PeerProgress, PendingProgress, PendingRead, RunListing, answered
from p2p_diloco.network.state_sync import SwarmState
from p2p_diloco.rounds.averager import GroupRequest, RoundOutcome, check_round_request


def clone_all(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [tensor.detach().clone() for tensor in tensors]


@dataclass(frozen=True)
class BegunRound:
    """One ``begin_round`` call as the averager received it (tensors copied)."""

    proposal: list[torch.Tensor]
    weight: float
    outer_round: int
    window_s: float
    probe: list[float]
    started_at: float
    tag: str = ""
    failing: bool = False  # the group's FaultPlan fails this round
    period_s: float = 0.0
    group: GroupRequest = GroupRequest()


@dataclass
class FaultPlan:
    """What goes wrong in one :class:`FakeGroup`'s rounds, decided before the test runs: the ``call``-th call (from 0,
    refused calls included) of ``begin_round`` by ``unit``'s averager is refused (as when the real averager's tensors
    are held) or begins a round that fails for the whole group (as when the quorum is not reached)."""

    failures: set[tuple[str, int]] = field(default_factory=set)
    refusals: set[tuple[str, int]] = field(default_factory=set)

    def fail(self, unit: str, call: int) -> FaultPlan:
        self.failures.add((unit, call))
        return self

    def refuse(self, unit: str, call: int) -> FaultPlan:
        self.refusals.add((unit, call))
        return self


class FakeGroup:
    """A fixed matchmaking group: the round completes once every member averager has begun it.

    Emulates a successful all-reduce (every member gets the weighted mean of the proposals, the largest member
    round and the probe drift) or, when ``faults`` fail a member's call, a round that failed for everyone.
    """

    def __init__(self, faults: FaultPlan | None = None):
        self.faults = faults if faults is not None else FaultPlan()
        self.members: list[FakeAverager] = []
        self.rounds: list[dict[FakeAverager, BegunRound]] = []  # every completed round, by member
        self._waiting: dict[FakeAverager, BegunRound] = {}

    def averager(self, template: Sequence[torch.Tensor], unit: str = "") -> FakeAverager:
        """A new member, ``unit``'s averager of tensor lists shaped like ``template``."""
        member = FakeAverager(self, template, unit)
        self.members.append(member)
        return member

    def _join(self, member: FakeAverager, begun: BegunRound) -> None:
        self._waiting[member] = begun
        if len(self._waiting) < len(self.members):
            return
        begun_rounds, self._waiting = self._waiting, {}
        self.rounds.append(begun_rounds)
        failed = any(begun.failing for begun in begun_rounds.values())
        for receiver, own in begun_rounds.items():
            receiver._deliver(self._outcome(list(begun_rounds.values()), own, failed))

    def _leave(self, member: FakeAverager) -> None:
        self._waiting.pop(member, None)

    def _outcome(self, begun_rounds: list[BegunRound], own: BegunRound, failed: bool) -> RoundOutcome:
        if failed:
            return RoundOutcome(
                None, 0, own.outer_round, 0.0, own.started_at, time.time(), error="FakeGroup: quorum not reached"
            )
        averaged = weighted_average([begun.proposal for begun in begun_rounds], [b.weight for b in begun_rounds])
        return RoundOutcome(
            averaged=clone_all(averaged),  # each member gets its own buffers, like the real averager
            group_size=len(begun_rounds),
            max_member_round=max(begun.outer_round for begun in begun_rounds),
            total_weight=sum(begun.weight for begun in begun_rounds),
            started_at=own.started_at,
            finished_at=time.time(),
            member_drift=probe_drift([begun.probe for begun in begun_rounds if begun.probe]),
            member_tags=tuple(begun.tag for begun in begun_rounds),
            member_periods=tuple(begun.period_s for begun in begun_rounds),
            position=next(index for index, begun in enumerate(begun_rounds) if begun is own),
        )


class FakeAverager:
    """Emulates ``OuterAverager`` as a learning unit uses it, within one :class:`FakeGroup`.

    Validates like the real one (one round at a time, matching shapes, positive weight) and records every
    ``begin_round`` in ``begun``. The emulated all-reduce ends the instant the group forms: ``finish_round``
    returns a ready outcome, else cancels (a group whose other members never begin does not end in time).
    """

    def __init__(self, group: FakeGroup, template: Sequence[torch.Tensor], unit: str = ""):
        self.group, self.unit = group, unit
        self.shapes = [tuple(tensor.shape) for tensor in template]
        self.begun: list[BegunRound] = []
        self.calls = 0  # begin_round calls so far (the group's FaultPlan counts them)
        self.cancelled = 0
        self.is_shut_down = False
        self._in_flight = False
        self._outcome: RoundOutcome | None = None

    @property
    def in_flight(self) -> bool:
        return self._in_flight

    def begin_round(
        self,
        proposal: Sequence[torch.Tensor],
        weight: float,
        outer_round: int,
        window_s: float,
        probe: Sequence[float] = (),
        tag: str = "",
        period_s: float = 0.0,
        group: GroupRequest = GroupRequest(),
        reference: Sequence[torch.Tensor] | None = None,
    ) -> bool:
        check_round_request(self._in_flight, self.shapes, proposal, weight, reference)
        call, self.calls = self.calls, self.calls + 1
        if (self.unit, call) in self.group.faults.refusals:
            return False
        failing = (self.unit, call) in self.group.faults.failures
        copied = clone_all(proposal)
        begun = BegunRound(copied, float(weight), int(outer_round), window_s, list(probe), time.time(), tag, failing,
                           period_s, group)  # fmt: skip
        self.begun.append(begun)
        self._in_flight = True
        self.group._join(self, begun)
        return True

    def _deliver(self, outcome: RoundOutcome) -> None:
        self._outcome = outcome

    def poll(self) -> RoundOutcome | None:
        outcome, self._outcome = self._outcome, None
        if outcome is not None:
            self._in_flight = False
        return outcome

    def finish_round(self, timeout_s: float) -> RoundOutcome | None:
        if self._outcome is not None:
            return self.poll()
        if self._in_flight:
            self.group._leave(self)
            self._in_flight = False
            self.cancelled += 1
        return None

    def shutdown(self) -> None:
        self.finish_round(0.0)
        self.is_shut_down = True


class FakeStateServer:
    """Emulates ``StateServer``: ``publish`` records copies of the states; ``download`` returns ``served``
    (a copy, like a validated download) or None when no donor answers."""

    def __init__(self, served: SwarmState | None = None):
        self.served = served
        self.published: list[SwarmState] = []
        self.downloads = 0

    def publish(self, state: SwarmState) -> None:
        self.published.append(_copy_state(state))

    def download(self, timeout_s: float, refused: frozenset[str] = frozenset()) -> SwarmState | None:
        """The served state from its donor (peer ``donor``), unless the caller refused that donor."""
        self.downloads += 1
        return None if self.served is None or "donor" in refused else _copy_state(self.served)

    def declared_rounds(self) -> dict[str, int]:
        """A served state is declared by the record of its donor (peer ``donor``), as in a swarm."""
        return {} if self.served is None else {"donor": self.served.outer_round}


def _copy_state(state: SwarmState) -> SwarmState:
    return SwarmState(
        clone_all(state.global_params),
        clone_all(state.momentum),
        list(state.fragment_rounds),
        state.inner_step,
        state.tokens,
        donors=("donor",),
    )


@dataclass
class FakeRecords:
    """Emulates ``SwarmRecords``' progress and fingerprint records of one run and the directory of runs, in memory
    (nothing expires)."""

    progress: dict[str, PeerProgress] = field(default_factory=dict)
    fingerprints: list[str] = field(default_factory=list)
    published: list[PeerProgress] = field(default_factory=list)  # every record, in order
    lifetimes: list[float] = field(default_factory=list)  # the ttl_s of each, in order
    runs: dict[str, RunListing] = field(default_factory=dict)  # the directory of runs
    listed: int = 0  # this run listed in it
    runs_reads: int = 0

    def publish_progress(self, progress: PeerProgress, ttl_s: float = 60, wait: bool = False) -> None:
        self.progress[progress.peer_id] = progress
        self.published.append(progress)
        self.lifetimes.append(ttl_s)

    def read_progress(self) -> dict[str, PeerProgress]:
        return dict(self.progress)

    def read_progress_soon(self) -> PendingProgress:
        return answered("fake_progress", dict(self.progress))

    def list_run(self, ttl_s: float = 600) -> None:
        self.listed += 1

    def read_runs_soon(self) -> PendingRead[dict[str, RunListing]]:
        self.runs_reads += 1
        return answered("fake_runs", dict(self.runs))

    def refresh_model_fingerprint(self, fingerprint: str, ttl_s: float = 3600) -> None:
        self.fingerprints.append(fingerprint)

    def publish_membership(self, ttl_s: float = 3600, wait: bool = False) -> None:
        pass


class TimedGroup(FakeGroup):
    """Members meet when they scheduled their rounds for the same moment of the test's clock (within ``tolerance_s``)
    and in the same subgroup, as units do at a boundary of the clock schedule. Set :attr:`now` before members begin
    rounds (a round is scheduled at its group request's ``scheduled_at``, else ``now + window_s``); :meth:`advance`
    ends the rounds scheduled ``tolerance_s`` before it or earlier, each with the members scheduled within
    ``tolerance_s`` of it, or alone (a group of one averages its own proposal, as with quorum 1); at most
    ``target_size`` members per group, earliest scheduled first."""

    def __init__(self, tolerance_s: float = 0.5, target_size: int | None = None):
        super().__init__()
        self.now, self.tolerance_s, self.target_size = 0.0, tolerance_s, target_size
        self._scheduled: dict[FakeAverager, tuple[float, BegunRound]] = {}

    def _join(self, member: FakeAverager, begun: BegunRound) -> None:
        self._scheduled[member] = (begun.group.scheduled_at or self.now + begun.window_s, begun)

    def _leave(self, member: FakeAverager) -> None:
        self._scheduled.pop(member, None)

    def advance(self, now: float) -> None:
        self.now = now
        while self._scheduled:
            first = min(at for at, _ in self._scheduled.values())
            if first + self.tolerance_s > now:
                return
            leader = next(begun for at, begun in self._scheduled.values() if at == first)
            near, key = self._scheduled.items(), leader.group.subgroup
            near_in_time = sorted((at, order, member) for order, (member, (at, begun)) in enumerate(near)
                                  if at - first <= self.tolerance_s and begun.group.subgroup == key)  # fmt: skip
            size = leader.group.size or self.target_size
            together = {member: self._scheduled[member][1] for _, _, member in near_in_time[:size]}
            for member in together:
                del self._scheduled[member]
            self.rounds.append(together)
            for receiver, own in together.items():
                receiver._deliver(self._outcome(list(together.values()), own, failed=False))
