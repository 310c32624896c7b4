"""hivemind's averager as every unit runs it: members only, and a bounded reducer (:class:`GatedAverager`).

Every averager of a unit (its fragments' rounds, consensus and settle rounds, its state server) is one, so a unit
takes part only with members of the run and combines each slice it reduces with the bounded mean (robust.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, AsyncIterator  # noqa: UP035 (hivemind reads RPC stream types from typing's alias)

import hivemind
import torch
from hivemind.averaging.control import StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_dht_time
from hivemind.utils.asyncio import as_aiter, azip

from p2p_diloco.network.membership import MemberGate
from p2p_diloco.network.reducer import BoundedAllReduceRunner, RoundReference, SenderVerdict
from p2p_diloco.trust import AGREEMENT_FLOOR, DIRECTION_ROUNDS, MAX_OFFENCES, OFFENCE_WINDOW

logger = logging.getLogger(__name__)

REFUSAL_LOG_EVERY_S = 60.0
HINT_RETRY_S = 0.2  # a hinted leader that turned a unit down is asked again this much later
KEY_BUCKETS = 1 << 12  # more than any group (their bits are set anew before every round: averaging.py)


class GatedAverager(hivemind.DecentralizedAverager):
    """hivemind's averager that takes part only with members of the run (membership.py ``MemberGate``), judged by the
    libp2p-authenticated peer id of every caller and groupmate.

    hivemind 1.1.12 has no hook to authorize a caller of the averager's RPCs (its authorizer guards DHT RPCs only), so
    the entry points a peer reaches are wrapped: a join request from a non-member is refused (``PROTOCOL_VIOLATION``),
    its parts or state requests are answered with nothing, a non-member declared as a leader is not asked to lead
    (hivemind's matchmaking has no filter of leaders: its per-leader request is wrapped in the averager process), and a
    group that contains a non-member anyway is left before any tensor is sent (the round retries matchmaking until its
    deadline, as for any failed group). In an open run the gate admits everyone.

    Its all-reduce reduces each slice with the bounded mean (robust.py, through reducer.py) instead of hivemind's plain
    weighted mean, checks the averaged parts the others return, and refuses, like a non-member, a member that offended
    (its parts invalid or far out of bounds, or its averages implausible: reducer.py) in MAX_OFFENCES of its last
    OFFENCE_WINDOW rounds with this averager (each averager counts its own; a refusal holds for all of the unit's
    averagers: membership.py ``SharedPeerSet``; so does a suspicion after one offence, for the settle rounds). A group
    of two whose other member offended in its last OFFENCE_WINDOW rounds is left the same way: a pair cannot bound it.

    A round's layout (rounds/grid.py, drawn from the round and the census: no member chooses it) is enforced the same
    way (:meth:`set_layout`): a unit placed in another group is refused as a leader, a follower or a groupmate, so two
    colluding identities cannot join one group by declaring its key.

    hivemind fixes a group's size at construction; :meth:`set_group_size` changes it between rounds (the clock
    schedule's rows and columns have sizes of their own: rounds/grid.py), through the same pipe to the averager
    process as hivemind's own ``set_group_bits``; call it once after the start. hivemind finds potential leaders
    only through DHT lookups of the group key, which a loaded swarm answered too late (16 units on one machine: rows'
    members that asked nobody ended alone); :meth:`set_leaders` names the units the layout expects to lead, asked at
    once.
    """

    _rpc_handlers = None  # hivemind caches RPC handlers per class: a subclass must collect its own
    _stub_type = None

    def __init__(self, *args: Any, gate: MemberGate, reference: RoundReference | None = None, **kwargs: Any) -> None:
        self.gate = gate
        self._reference = reference
        self._hinted: list[tuple[PeerID, float]] = []  # the leaders set_leaders hinted (averager process)
        self._found: list[tuple[PeerID, float]] = []  # what the round's last DHT lookup found
        self._lookup_at_once = False  # the next lookup answers from the hints and the last one, not the DHT
        self._refusals_logged: dict[tuple[str, str], float] = {}
        self._offences: dict[str, deque[bool]] = {}
        self._directions = StepDirections()
        self._layout: tuple[frozenset[str], frozenset[str]] = (frozenset(), frozenset())  # (this group, all placed)
        super().__init__(*args, **kwargs)

    def set_group_size(self, size: int) -> None:
        """The next rounds' groups recruit at most ``size`` members and start at once with that many; returns once the
        averager process took it."""
        future: MPFuture = MPFuture()
        self._outer_pipe.send(("_set_group_size", [], dict(size=size, future=future)))
        future.result()

    async def _set_group_size(self, size: int, future: MPFuture) -> None:
        matchmaking = self._matchmaking
        matchmaking.target_group_size = matchmaking.potential_leaders.target_group_size = size
        # after a group, the key manager draws each member's next bits from this many buckets, one per member at
        # least (else it raises, and the round fails): a leader may assemble more units than this one expected
        matchmaking.group_key_manager.target_group_size = KEY_BUCKETS
        future.set_result(None)

    def set_leaders(self, leaders: Sequence[tuple[str, float]]) -> None:
        """The next round asks these units (peer id, the expiration they declare) to lead before its DHT lookups show
        them, earliest first; returns once the averager process took them. Empty: the DHT alone, as in hivemind."""
        future: MPFuture = MPFuture()
        self._outer_pipe.send(("_set_leaders", [], dict(leaders=list(leaders), future=future)))
        future.result()

    async def _set_leaders(self, leaders: list[tuple[str, float]], future: MPFuture) -> None:
        self._hinted = [(PeerID.from_base58(peer_id), expiration) for peer_id, expiration in leaders]
        self._found, self._lookup_at_once = [], bool(self._hinted)
        self._look_up_hinted_leaders()
        future.set_result(None)

    def set_layout(self, members: Sequence[str], placed: Sequence[str]) -> None:
        """The next rounds take part only with units of ``members`` among those the round's layout ``placed``
        (rounds/grid.py): a placed unit outside ``members`` is refused as a leader, a follower or a groupmate; a unit
        the layout did not place (a joiner not yet in this unit's census) is not. Empty: no layout. Returns once the
        averager process took it."""
        future: MPFuture = MPFuture()
        self._outer_pipe.send(("_set_layout", [], dict(members=list(members), placed=list(placed), future=future)))
        future.result()

    async def _set_layout(self, members: list[str], placed: list[str], future: MPFuture) -> None:
        self._layout = (frozenset(members), frozenset(placed))
        future.set_result(None)

    def _placed_elsewhere(self, peer_id: PeerID) -> bool:
        members, placed = self._layout
        return str(peer_id) in placed and str(peer_id) not in members

    def _look_up_hinted_leaders(self) -> None:
        """Wrap the key manager's lookup of the averagers declared under a group key (the one source of hivemind's
        potential leaders; it has no hook for others): a round's first lookup returns the hinted leaders at once,
        later ones what the DHT shows plus the hinted leaders it does not show (with_hinted_leaders). A hinted leader
        that turned this unit down is asked again HINT_RETRY_S later, the lookup then answered from the hints and the
        last DHT answer (:meth:`_ask_only_members_to_lead`): units begin their rounds in any order, and one asked
        before it began answers NOT_LOOKING_FOR_GROUP, after which hivemind never asks it again that round (16 units:
        119 such refusals, those followers ended alone); asked again only after the next DHT lookup, column members of
        a 16-unit run still ended their mix rounds alone, the lookup coming back after the round's end."""
        key_manager = self._matchmaking.group_key_manager
        if getattr(key_manager, "hints_leaders", False):
            return
        get_averagers = key_manager.get_averagers

        async def get_averagers_and_hinted(group_key: str, only_active: bool) -> list[tuple[PeerID, float]]:
            if not self._lookup_at_once:
                self._found = await get_averagers(group_key, only_active)
            self._lookup_at_once = False
            return with_hinted_leaders(self._found, self._hinted)

        key_manager.get_averagers = get_averagers_and_hinted
        key_manager.hints_leaders = True

    async def _refuses(self, peer_id: PeerID, what: str) -> bool:
        """Whether to refuse ``peer_id``: not admitted by the gate, or placed in another group of this round's layout
        (:meth:`set_layout`); a refusal is logged once per REFUSAL_LOG_EVERY_S for each peer and kind."""
        if self._placed_elsewhere(peer_id):  # an honest unit of another group: no warning
            why, level = "placed in another group of this round's layout", logging.INFO
        elif await self.gate.admits(peer_id, self.dht):
            return False
        else:
            why = "refused after its offences" if self.gate.refused(str(peer_id)) else "not a member of the run"
            level = logging.WARNING
        now, key = time.monotonic(), (str(peer_id), what)
        if now - self._refusals_logged.get(key, -math.inf) >= REFUSAL_LOG_EVERY_S:
            self._refusals_logged[key] = now
            logger.log(level, "refused %s from %s: %s", what, peer_id, why)
        return True

    async def _step(self, *, step: StepControl, future_for_init: Any) -> None:
        self._ask_only_members_to_lead()
        await super()._step(step=step, future_for_init=future_for_init)

    def _ask_only_members_to_lead(self) -> None:
        matchmaking = self._matchmaking
        if getattr(matchmaking, "asks_members_only", False):
            return
        request_join_group = matchmaking._request_join_group

        async def request_join_group_of_a_member(leader: PeerID) -> GroupInfo | None:
            refused = await self._refuses(leader, "a lead")
            group = None if refused else await request_join_group(leader)
            hinted = [attempt for attempt in self._hinted if attempt[0] == leader]
            if group is None and hinted and not refused:  # it may not have begun yet: asked again, without a lookup
                matchmaking.potential_leaders.past_attempts.difference_update(hinted)
                await asyncio.sleep(HINT_RETRY_S)
                self._lookup_at_once = True
            return group

        matchmaking._request_join_group = request_join_group_of_a_member
        matchmaking.asks_members_only = True

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if await self._refuses(context.remote_id, "a join request"):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for response in super().rpc_join_group(request, context):
            yield response

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        if await self._refuses(context.remote_id, "an all-reduce part"):
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_aggregate_part(stream, context):
            yield message

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        if await self._refuses(context.remote_id, "a state download"):
            return
        async for message in super().rpc_download_state(request, context):
            yield message

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: bytes | None = None, **kwargs: Any
    ) -> None:
        """hivemind's, with the bounded reducer (reducer.py) as the all-reduce runner (units never run as aux peers)."""
        group_id = group_info.group_id if group_id is None else group_id
        runner = BoundedAllReduceRunner(p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=tensors,
                                        group_id=group_id, ordered_peer_ids=group_info.peer_ids,
                                        on_verdicts=self._judge, reference=self._reference_of_this_round(),
                                        **kwargs)  # fmt: skip
        self._running_groups[group_id].set_result(runner)
        try:
            async for tensor, update in azip(as_aiter(*tensors), runner):
                tensor.add_(update, alpha=self._averaging_alpha)
                self.last_updated = get_dht_time()
                self._state_updated.set()
        except BaseException as error:  # a timeout cancels this: hivemind finalizes the runner only once its
            runner.finalize(exception=error)  # generator is collected; the members waiting on this unit learn now
            raise

    def _reference_of_this_round(self) -> list[torch.Tensor] | None:
        """The round's reference (the payload of a unit that trained nothing), if its round has one."""
        if self._reference is None or not self._reference.is_set():
            return None
        return self._reference.tensors

    def _judge(self, verdicts: dict[PeerID, SenderVerdict]) -> None:
        """Log the members whose parts this unit clipped, capped or dropped or whose averages it replaced; refuse a
        member for the rest of the run once it offended in MAX_OFFENCES of its last OFFENCE_WINDOW rounds: by its
        parts or averages in that round (reducer.py), or by the direction of its steps (:class:`StepDirections`)."""
        for peer_id, verdict in verdicts.items():
            history = self._offences.setdefault(str(peer_id), deque(maxlen=OFFENCE_WINDOW))
            pulls_away = self._directions.judge(str(peer_id), verdict.agreement)
            offended = verdict.offended or pulls_away is not None
            history.append(offended)
            summary = verdict.summary() + (f"; {pulls_away}" if pulls_away else "")
            if not offended:
                logger.log(logging.INFO if verdict.noteworthy else logging.DEBUG, "member %s: %s", peer_id, summary)
                continue
            offences = sum(history)
            self.gate.suspect(str(peer_id))
            logger.warning("member %s offended: %s (%d offences in its last %d rounds, refused at %d)", peer_id,
                           summary, offences, len(history), MAX_OFFENCES)  # fmt: skip
            if offences >= MAX_OFFENCES and not self.gate.refused(str(peer_id)):
                self.gate.refuse(str(peer_id))
                logger.warning("member %s refused for the rest of the run after %d offences", peer_id, offences)

    async def _shutdown(self, timeout: float | None) -> None:
        """hivemind 1.1.12's shutdown, mended: it calls ``finalize`` on the futures its running groups are kept in
        (an AttributeError traceback from every unit that left with a round in flight: the emulated-WAN benchmark's
        exits), so the all-reduces in flight were never cancelled. Here each running group whose runner is known is
        cancelled, so its members learn at once; ``timeout`` is unused (nothing is awaited)."""
        if not self.client_mode:
            await self.remove_p2p_handlers(self._p2p, namespace=self.prefix)
        for running in self._running_groups.values():
            if running.done() and not running.cancelled() and running.exception() is None:
                running.result().finalize(cancel=True)

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any) -> Any:
        others = [peer_id for peer_id in group_info.peer_ids if peer_id != self.peer_id]
        for peer_id in others:
            if await self._refuses(peer_id, "a group"):
                raise MatchmakingException(f"group {group_info.group_id!r} has {peer_id}, which this unit refuses")
        if self._pairs_with_an_offender(others):
            raise MatchmakingException(f"group {group_info.group_id!r} pairs this unit with {others[0]}, which "
                                       f"offended in its last {OFFENCE_WINDOW} rounds")  # fmt: skip
        return await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)

    def _pairs_with_an_offender(self, others: Sequence[PeerID]) -> bool:
        """Whether a group is this unit and one member that offended in any of its last OFFENCE_WINDOW rounds with
        this averager: in a pair the bounded mean is the plain mean (nothing tells which member lies), so such a
        member's part would not be bounded at all."""
        return len(others) == 1 and any(self._offences.get(str(others[0]), ()))


class StepDirections:
    """Each member's steps judged by their direction over rounds: a member pulls against this unit when the mean of
    its steps' agreements with this unit's (reducer.py ``SenderVerdict.agreement``) over its last OFFENCE_WINDOW judged
    rounds, DIRECTION_ROUNDS at least, is below AGREEMENT_FLOOR. One round's cosine is noisy (honest members' rounds
    spread from -0.16 to +0.77 in the security benchmark, tiny preset); a flipped step's mean is negative, an honest
    one's positive."""

    def __init__(self) -> None:
        self._agreements: dict[str, deque[float]] = {}

    def judge(self, peer_id: str, agreement: float | None) -> str | None:
        """Note this round's ``agreement`` of ``peer_id`` (None: not judged) and say why it pulls against this unit's
        steps (None: it does not, too few rounds judged it, or this round did not)."""
        agreements = self._agreements.setdefault(peer_id, deque(maxlen=OFFENCE_WINDOW))
        if agreement is None:
            return None
        agreements.append(agreement)
        mean = statistics.fmean(agreements)
        if len(agreements) < DIRECTION_ROUNDS or mean >= AGREEMENT_FLOOR:
            return None
        return f"its steps pull against this unit's (mean agreement {mean:+.2f} over its last {len(agreements)} rounds)"


def with_hinted_leaders(
    found: list[tuple[PeerID, float]], hinted: Sequence[tuple[PeerID, float]]
) -> list[tuple[PeerID, float]]:
    """The averagers a DHT lookup ``found`` (peer, declared expiration) and the ``hinted`` leaders it did not find."""
    shown = {peer for peer, _ in found}
    return [*found, *[(peer, expiration) for peer, expiration in hinted if peer not in shown]]
