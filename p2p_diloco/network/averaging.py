"""Average one outer round with reachable peers: :class:`OuterAverager` implements the round engine's seam to the
network (rounds/averager.py ``Averager``) on hivemind's ``DecentralizedAverager``.

A round is started with :meth:`OuterAverager.begin_round` and never blocks: matchmaking and the all-reduce
run in hivemind's averager process while the unit keeps training, and :meth:`OuterAverager.poll` returns
the outcome once there is one.

Group formation (hivemind 1.1.12 semantics, measured): a unit declares itself for a *window* of seconds;
units that reach their own sync point inside that window join it, and the group starts its all-reduce
when the window ends (at once if ``target_group_size`` members joined). Quorum K:

* K = 1 (never wait): if nobody joins within the window, the round completes alone with the unit's own
  proposal (group size 1), read back from the averager's buffer (the unit does not keep a second copy of what it
  sent while the round is in flight); where an all-reduce broke off, hivemind has already written the averages of
  some tensors into that buffer, and those are taken with the others' own values. hivemind's ``min_group_size=1``
  would form a solo group instantly and never wait for anyone, so the averager runs with ``min_group_size=2`` and
  the solo fallback lives here.
* K ≥ 2: a round with fewer than K members fails; the caller keeps its global parameters unchanged and
  the progress stays in the next pseudo-gradient (nothing is lost).

A client (a unit no other can connect to, ``--no-use-relays``) leads no group: its round recruits for CLIENT_REACH
windows, to follow any leader whose window overlaps its own.

Each member reduces a slice of the group's tensors for everyone with a bounded mean (robust.py): one member's
part, weight or non-finite values cannot move an average of three or more members far, and are logged with its peer
id; members that keep offending, and non-members of a private run (membership.py), are refused.

A member that dies mid-all-reduce does not fail the round for the survivors: its shard of the result keeps
the survivor's own values (a partial average). Averaging outer-step proposals makes that harmless: the
next rounds average those shards again (see diloco.py).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections.abc import Sequence
from concurrent.futures import InvalidStateError
from dataclasses import dataclass

import hivemind
import torch
from hivemind.averaging.control import StepControl
from hivemind.compression import CompressionBase, NoCompression
from hivemind.utils import get_dht_time

from p2p_diloco.diloco import probe_drift
from p2p_diloco.network.gated import GatedAverager
from p2p_diloco.network.members import MemberInfo, read_member
from p2p_diloco.network.membership import MemberGate
from p2p_diloco.network.reducer import RoundReference
from p2p_diloco.rounds.averager import GroupRequest, RoundOutcome, check_round_request

logger = logging.getLogger(__name__)

TENSOR_LOCK_WAIT_S = 0.05  # longest an inner step waits for the averaged tensors
LOCK_WARNING_EVERY_S = 30.0
STUCK_MARGIN_S = 5.0  # the tensors' lock busy this long past the all-reduce timeout: the averager is restarted
CLIENT_REACH = 2
"""A client's round reaches this many windows: it leads no group, and hivemind's leader refuses a request that expires
before its own window ends, so a client whose window began before a leader's (in phase, round after round) merged
nothing while the leader stayed alone; with two windows it follows any leader whose window overlaps its own."""


@dataclass
class _PendingRound:
    control: StepControl
    weight: float
    outer_round: int
    tag: str
    started_at: float
    probe_length: int


class OuterAverager:
    """Averages fixed-shape CPU tensor lists (a fragment's outer-step proposals, pseudo-gradients or consensus
    payload) with whichever peers are matchmaking.

    Peers are grouped under ``prefix``: give a prefix that includes the run id, the model fingerprint and whatever
    must match (fragment, codec) so that units that cannot average together never meet. ``compression`` is the
    hivemind codec of every part sent (default: none); ``gate`` says who may take part (default: everyone). Owns a
    hivemind averager process; call :meth:`shutdown` (also on errors) to stop it.
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        prefix: str,
        template: Sequence[torch.Tensor],
        *,
        quorum: int,
        target_group_size: int,
        allreduce_timeout_s: float,
        request_timeout_s: float = 1.0,
        compression: CompressionBase | None = None,
        gate: MemberGate | None = None,
        directed: bool = False,
    ):
        gate = gate if gate is not None else MemberGate.everyone()
        self.quorum = quorum
        self._shapes = [tuple(tensor.shape) for tensor in template]
        self._stuck_after_s = allreduce_timeout_s + STUCK_MARGIN_S
        buffers = [torch.zeros_like(tensor, dtype=torch.float32, device="cpu") for tensor in template]
        self._shared = buffers  # hivemind moves them to shared memory in place
        self._reference = RoundReference(template) if directed else None
        self._new_averager = functools.partial(  # a restarted averager takes over the same (shared) buffers
            GatedAverager,
            gate=gate,
            reference=self._reference,
            averaged_tensors=buffers,
            dht=dht,
            start=True,
            prefix=prefix,
            target_group_size=max(target_group_size, 2),
            min_group_size=max(quorum, 2),
            min_matchmaking_time=request_timeout_s * 1.5,
            request_timeout=request_timeout_s,
            allreduce_timeout=allreduce_timeout_s,
            compression=compression if compression is not None else NoCompression(),
            # hivemind would serve these tensors to anyone and re-declare them in the DHT every 30 s; the state
            # server (state_sync.py) is the one that serves a unit's state
            allow_state_sharing=False,
        )
        self._target_size = self._group_size = max(target_group_size, 2)  # the default and the current group cap
        self._averager = self._start_averager()
        self._pending: _PendingRound | None = None
        self._last_lock_warning = -math.inf
        self._lock_busy_since: float | None = None
        self._subgroup_dirty = False  # the averager's group bits may differ from "" (set for a subgroup round)
        self._leaders_hinted = False  # the averager process holds leaders of the last round (set_leaders)
        self._layout_set = False  # ... and a layout (set_layout)

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
        """Start averaging ``proposal`` (weighted by ``weight`` > 0) in the background; returns at once.

        ``probe`` (see ``diloco.consensus_probe``) is shared with the group to measure how far apart the
        members' global parameters were; ``tag`` too, so that members can check they averaged the same thing;
        ``period_s`` too (the clock schedule's agreement on a period). ``group.subgroup`` (bits) selects hivemind's
        group key ``prefix.0b<subgroup>``: only units of the same subgroup meet. hivemind rewrites non-empty group
        bits after every group it assembles, so they are set again before every round. ``group.size`` (0: the target
        size given at construction) caps the group (GatedAverager ``set_group_size``); ``group.leaders`` are asked
        to lead first (GatedAverager ``set_leaders``); ``group.members`` and ``group.placed`` are enforced
        (GatedAverager ``set_layout``). ``reference`` (the payload of a unit that trained nothing since
        φ) lets this unit judge the direction of each member's step in the slice it reduces; it is used only by an
        averager constructed ``directed`` (its shared copy costs one more payload of memory).

        Returns False, having started nothing, when the averager process holds its tensors (see
        :meth:`_tensors_free`): the caller tries again later instead of blocking its inner loop. Raises RuntimeError
        if a round is already in flight and ValueError for a proposal of another shape.
        """
        check_round_request(self._pending is not None, self._shapes, proposal, weight, reference)
        now = get_dht_time()  # the window counts from the call: copying the proposal must not shift the schedule
        if not self._tensors_free():
            if not self._stuck():
                return False
            self._restart()
        with self._averager.get_tensors() as buffers:
            for buffer, tensor in zip(buffers, proposal):
                buffer.copy_(tensor.detach())
        if self._reference is not None:
            self._reference.hold(reference)
        if group.subgroup or self._subgroup_dirty:
            self._averager.set_group_bits(group.subgroup)
            self._subgroup_dirty = bool(group.subgroup)
        # a group that reaches its size starts at once, before hivemind checks min_group_size: never below the quorum
        size = max(group.size, self.quorum, 2) if group.size else self._target_size
        if size != self._group_size:
            self._averager.set_group_size(size)
            self._group_size = size
        scheduled = max(group.scheduled_at, now) if group.scheduled_at else now + window_s
        if group.placed or self._layout_set:
            self._averager.set_layout(group.members, group.placed)
            self._layout_set = bool(group.placed)
        if group.leaders or self._leaders_hinted:  # they schedule at the same time plus their offsets
            self._averager.set_leaders([(leader.peer_id, scheduled + leader.offset_s) for leader in group.leaders])
            self._leaders_hinted = bool(group.leaders)
        gather = dict(outer_round=int(outer_round), weight=float(weight), probe=list(probe), tag=str(tag),
                      period=float(period_s))  # fmt: skip
        reach_s = scheduled - now
        if self._averager.client_mode:
            reach_s += (CLIENT_REACH - 1) * window_s
        control = self._averager.step(
            weight=float(weight),
            gather=gather,
            scheduled_time=now + reach_s,
            timeout=reach_s + 1.0,
            allow_retries=True,
            wait=False,
        )
        self._pending = _PendingRound(control, float(weight), int(outer_round), str(tag), time.time(), len(probe))
        return True

    def _start_averager(self) -> GatedAverager:
        """A new hivemind averager (the same prefix, settings and shared buffers), at the default group size."""
        averager = self._new_averager()
        averager.set_group_size(self._target_size)
        self._group_size = self._target_size
        return averager

    def _tensors_free(self) -> bool:
        """Whether the averaged tensors' lock can be taken within TENSOR_LOCK_WAIT_S (it is released at once).

        The averager process holds it for a whole all-reduce, and hivemind 1.1.12 can leave it held for good: a step
        cancelled while its process waits for the lock in a worker thread (seen after a unit was frozen mid-round and
        thawed) never releases it. Probing first keeps the inner loop from blocking on it; a lock taken between the
        probe and the copy is an ordinary all-reduce, bounded by its timeout. A lock busy for longer than any
        all-reduce may take is stuck (:meth:`_stuck`)."""
        lock = self._averager.lock_averaged_tensors
        if lock.acquire(timeout=TENSOR_LOCK_WAIT_S):
            lock.release()
            self._lock_busy_since = None
            return True
        now = time.monotonic()
        self._lock_busy_since = now if self._lock_busy_since is None else self._lock_busy_since
        if now - self._last_lock_warning >= LOCK_WARNING_EVERY_S:
            logger.warning("averaged tensors are held by the averager process; retrying at the next inner step")
            self._last_lock_warning = now
        return False

    def _stuck(self) -> bool:
        """The tensors' lock has been busy for longer than the all-reduce timeout plus STUCK_MARGIN_S."""
        busy_since = self._lock_busy_since
        return busy_since is not None and time.monotonic() - busy_since > self._stuck_after_s

    def _restart(self) -> None:
        """Replace a stuck hivemind averager with a new one (same prefix and settings; about a second)."""
        logger.warning("the averager kept its tensors locked for over %.0f s: restarting it", self._stuck_after_s)
        self._averager.shutdown()
        self._averager = self._start_averager()
        self._lock_busy_since = None
        self._subgroup_dirty = self._leaders_hinted = False

    def poll(self) -> RoundOutcome | None:
        """The outcome of the round in flight once it ended, else None. Never raises for network failures."""
        pending = self._pending
        if pending is None or not pending.control.done():
            return None
        if not self._tensors_free():
            if not self._stuck():
                return None
            self._pending = None
            self._restart()
            return self._without_group(pending, "the averager kept its tensors locked after the round (restarted)")
        self._pending = None
        try:
            gathered = pending.control.result()
        except BaseException as error:  # hivemind surfaces matchmaking and all-reduce failures here
            return self._without_group(pending, f"{type(error).__name__}: {error}")
        if not gathered:
            return self._without_group(pending, "averager returned no group")
        averaged = self._buffers()
        infos = self._read_members(gathered, pending)
        members = list(gathered)
        position = members.index(self._averager.peer_id) if self._averager.peer_id in members else 0
        return RoundOutcome(
            averaged=averaged,
            group_size=len(gathered),
            max_member_round=max([pending.outer_round] + [info.outer_round for info in infos]),
            total_weight=sum(info.weight for info in infos),
            started_at=pending.started_at,
            finished_at=time.time(),
            member_drift=probe_drift([info.probe for info in infos if info.probe]),
            member_tags=tuple(info.tag for info in infos),
            member_periods=tuple(info.period for info in infos),
            position=position,
        )

    def _read_members(self, gathered: dict, pending: _PendingRound) -> list[MemberInfo]:
        """Every member's gather, validated (members.py); what was not believed is logged with the member's id."""
        infos = []
        for peer_id, value in gathered.items():
            info = read_member(value, pending.outer_round, pending.probe_length)
            if info.problems:
                logger.warning("outer round %d: member %s: %s (not believed)", pending.outer_round, peer_id,
                               "; ".join(info.problems))  # fmt: skip
            infos.append(info)
        return infos

    def _buffers(self) -> list[torch.Tensor]:
        """The averaged tensors themselves (the group's average after a round, else (mostly) what was sent), not a
        copy: nothing writes them until the next :meth:`begin_round` (RoundOutcome's contract), and a copy of the
        payload at every round's end was a unit's peak memory."""
        with self._averager.get_tensors() as buffers:
            return list(buffers)

    def _without_group(self, pending: _PendingRound, error: str) -> RoundOutcome:
        """No usable group: with quorum 1 the round completes alone with what the buffers hold (the module
        docstring; a restarted averager shares the same buffers), otherwise it fails."""
        if self.quorum == 1:
            logger.debug("outer round %d completed alone: %s", pending.outer_round, error)  # the unit logs the round
            return RoundOutcome(
                averaged=self._buffers(),
                group_size=1,
                max_member_round=pending.outer_round,
                total_weight=pending.weight,
                started_at=pending.started_at,
                finished_at=time.time(),
                error=error,
                member_tags=(pending.tag,),
            )
        logger.debug("outer round %d failed (quorum %d not reached): %s", pending.outer_round, self.quorum, error)
        return RoundOutcome(None, 0, pending.outer_round, 0.0, pending.started_at, time.time(), error=error)

    def finish_round(self, timeout_s: float) -> RoundOutcome | None:
        """For shutdown: wait up to ``timeout_s`` for the round in flight to end (matchmaking included) and return
        its outcome; a round still running at the deadline is cancelled and dropped (None)."""
        pending = self._pending
        if pending is None:
            return None
        deadline = time.monotonic() + timeout_s
        while not pending.control.done() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not pending.control.done():
            _cancel(pending.control)
            self._pending = None
            return None
        return self.poll()

    def shutdown(self) -> None:
        """Stop the averager process and free the shared buffers (their memory: a unit's exit starts its settle
        averager after shutting its round averagers down). The averager is of no more use after."""
        if self._pending is not None:
            _cancel(self._pending.control)
        self._pending = None
        if self._averager.is_alive():  # hivemind logs an exception for a second shutdown
            self._averager.shutdown()
        for tensor in [*self._shared, *(self._reference.tensors if self._reference is not None else ())]:
            tensor.set_()  # every holder of these tensor objects (hivemind's averager too) now holds no storage


def _cancel(control: StepControl) -> None:
    """Cancel a step unless it already ended or was already cancelled (hivemind raises for those)."""
    if not control.done():
        with contextlib.suppress(InvalidStateError):
            control.cancel()
