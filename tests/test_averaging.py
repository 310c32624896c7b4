"""OuterAverager against a real hivemind averager on 127.0.0.1: a held tensors lock never blocks the caller, and an
averager that keeps it is replaced."""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import hivemind
import pytest
import torch
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.p2p import PeerID
from swarms import record_peers

from p2p_diloco.network import reducer
from p2p_diloco.network.averaging import STUCK_MARGIN_S, TENSOR_LOCK_WAIT_S, OuterAverager
from p2p_diloco.network.dht import stop_dht
from p2p_diloco.network.gated import GatedAverager, StepDirections, with_hinted_leaders
from p2p_diloco.network.membership import MemberGate
from p2p_diloco.network.reducer import SenderVerdict
from p2p_diloco.robust import BoundedMean, bounded_mean
from p2p_diloco.rounds.averager import GroupRequest, RoundOutcome
from p2p_diloco.rounds.grid import SPACING_S, Leader
from p2p_diloco.trust import DIRECTION_ROUNDS, MAX_OFFENCES, OFFENCE_RELATIVE, OFFENCE_WINDOW

PEERS = (
    "QmThfFo7CortpE8Toa1uKgQUkjEbTgJKg6GQCr9gcWXAkW",
    "QmdnYJu9gnaYnhckJnQ1UpA9afhH8MsVAzpPZU2fsiEEEG",
    "QmYPh3tEtNvEVsgaoWL9rt36L6M3FyygCtRgfmZxGSJE5X",
)
STALL_S = 8.0  # longer than the all-reduce timeout of the stalling test (4 s)


@pytest.mark.swarm
def test_a_held_tensors_lock_defers_the_round_instead_of_blocking() -> None:
    """While the averager process would hold its tensors (here: the test holds the lock), begin_round returns False
    at once and poll returns nothing; once the lock is free the round begins and completes alone (quorum 1) with
    what it sent, which the averager did not keep a reference to."""
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    averager = OuterAverager(dht, "lock-test", [torch.zeros(8)], quorum=1, target_group_size=2, allreduce_timeout_s=5)
    try:
        lock = averager._averager.lock_averaged_tensors  # the lock hivemind's averager process takes
        assert lock.acquire(timeout=5)
        try:
            started = time.monotonic()
            assert averager.begin_round([torch.ones(8)], weight=1.0, outer_round=0, window_s=0.5) is False
            assert time.monotonic() - started < TENSOR_LOCK_WAIT_S + 0.5
            assert averager.poll() is None
        finally:
            lock.release()
        proposal = [torch.ones(8)]
        assert averager.begin_round(proposal, weight=1.0, outer_round=0, window_s=0.5) is True
        sent = weakref.ref(proposal[0])
        del proposal
        assert sent() is None  # no second copy while the round is in flight: alone, the buffer is read back
        outcome = averager.finish_round(timeout_s=10.0)
        assert outcome is not None and outcome.group_size == 1
        assert torch.equal(outcome.averaged[0], torch.ones(8))
    finally:
        averager.shutdown()
        stop_dht(dht)


@pytest.mark.swarm
def test_shutdown_frees_the_shared_buffers() -> None:
    """A unit shuts its round averagers down at exit before its settle averager starts: their shared buffers (the
    payload, and a directed averager's reference) hold no memory after, whoever still refers to them."""
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    averager = OuterAverager(dht, "free-test", [torch.zeros(64), torch.zeros(8)], quorum=1, target_group_size=2,
                             allreduce_timeout_s=5, directed=True)  # fmt: skip
    try:
        assert averager._reference is not None
        held = [*averager._averager._averaged_tensors, *averager._reference.tensors]  # hivemind's and the reducer's
        assert sum(tensor.untyped_storage().nbytes() for tensor in held) == 2 * 72 * 4
        averager.shutdown()
        assert sum(tensor.untyped_storage().nbytes() for tensor in held) == 0
    finally:
        averager.shutdown()
        stop_dht(dht)


@pytest.mark.swarm
def test_an_averager_stuck_with_its_tensors_locked_is_restarted() -> None:
    """A lock that stays taken (as hivemind can leave it after a cancelled step) defers rounds only until it has been
    busy for longer than the all-reduce timeout plus the margin; then a new averager takes the round."""
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    averager = OuterAverager(dht, "stuck-test", [torch.zeros(8)], quorum=1, target_group_size=2, allreduce_timeout_s=1)
    try:
        assert averager._averager.lock_averaged_tensors.acquire(timeout=5)  # never released: the leak
        started = time.monotonic()
        deadline = started + 1 + STUCK_MARGIN_S + 10
        while not averager.begin_round([torch.ones(8)], weight=1.0, outer_round=0, window_s=0.5):
            assert time.monotonic() < deadline, "the stuck averager was never restarted"
            time.sleep(0.2)
        assert time.monotonic() - started >= 1 + STUCK_MARGIN_S
        outcome = averager.finish_round(timeout_s=10.0)
        assert outcome is not None and torch.equal(outcome.averaged[0], torch.ones(8))
    finally:
        averager.shutdown()
        stop_dht(dht)


@pytest.mark.swarm
def test_a_client_follows_a_leader_whose_window_ends_after_its_own() -> None:
    """A client (no inbound connections) leads no group: it must follow a leader, and hivemind's leader refuses a
    request that expires before its own window ends. A client whose round began 0.6 windows before the leader's
    (whose window thus ends later) merged nothing and the leader stayed alone, round after round while their
    cadences stayed in phase (66 s in one relay test); now they average in a group of two."""
    window_s = 2.0
    leader_dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    client_dht = hivemind.DHT(start=True, client_mode=True, initial_peers=leader_dht.get_visible_maddrs())
    leader = OuterAverager(leader_dht, "client", [torch.zeros(8)], quorum=1, target_group_size=2,
                           allreduce_timeout_s=5)  # fmt: skip
    client = OuterAverager(client_dht, "client", [torch.zeros(8)], quorum=2, target_group_size=2,
                           allreduce_timeout_s=5)  # fmt: skip
    try:
        assert client.begin_round([torch.zeros(8)], weight=1.0, outer_round=0, window_s=window_s)
        time.sleep(0.6 * window_s)
        assert leader.begin_round([torch.ones(8)], weight=1.0, outer_round=0, window_s=window_s)
        outcomes = [averager.finish_round(timeout_s=3 * window_s + 10) for averager in (client, leader)]
        for outcome in outcomes:
            assert outcome is not None and outcome.group_size == 2, outcome
            assert torch.allclose(outcome.averaged[0], torch.full((8,), 0.5))
    finally:
        for averager in (client, leader):
            averager.shutdown()
        stop_dht(client_dht)
        stop_dht(leader_dht)


def average_once(
    averagers: list[OuterAverager], payloads: list[torch.Tensor], number: int
) -> list[RoundOutcome | None]:
    """Round ``number`` of ``averagers``, each averaging its payload with weight 1 in a 3 s window; their outcomes."""
    for averager, payload in zip(averagers, payloads):
        assert averager.begin_round([payload], weight=1.0, outer_round=number, window_s=3.0)
    return [averager.finish_round(timeout_s=30.0) for averager in averagers]


@pytest.mark.swarm
def test_a_member_far_out_of_bounds_is_left_out() -> None:
    """Three averagers on real DHT nodes, one sending 1000 × its proposal: whatever group a round forms (the reducers
    may also refuse the sender after its offences), an honest member ends with the honest members' mean (the far
    part dropped by the reducers) or, alone, its own proposal."""
    size = 30_000
    generator = torch.Generator().manual_seed(0)
    with record_peers(3) as peers:
        averagers = [OuterAverager(peer.dht, "bounded", [torch.zeros(size)], quorum=1, target_group_size=3,
                                   allreduce_timeout_s=10) for peer in peers]  # fmt: skip
        try:
            for number in range(MAX_OFFENCES + 1):
                proposals = [1 + 0.01 * torch.randn(size, generator=generator) for _ in averagers]
                proposals[-1] = proposals[-1] * 1000
                outcomes = average_once(averagers, proposals, number)
                honest_mean = (proposals[0] + proposals[1]) / 2
                for outcome, own in zip(outcomes[:2], proposals):
                    assert outcome is not None and outcome.averaged is not None
                    expected = own if outcome.group_size == 1 else honest_mean
                    gap = float((outcome.averaged[0] - expected).norm() / expected.norm())
                    assert gap < 0.01, (number, outcome.group_size, gap)
        finally:
            for averager in averagers:
                averager.shutdown()


@pytest.mark.swarm
def test_a_reducer_returning_implausible_averages_is_replaced_then_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three averagers, the third of which, as a reducer, returns 1000 × the average of its slice: the honest members
    keep their own values of that slice (and the honest average of the others), never its averages, and refuse it
    after MAX_OFFENCES rounds with it (then they average in pairs)."""
    size = 400_000  # several parts of hivemind's 512 KiB: every member reduces a slice
    generator = torch.Generator().manual_seed(1)
    with record_peers(3) as peers:
        averagers = [OuterAverager(peer.dht, "reducer", [torch.zeros(size)], quorum=1, target_group_size=3,
                                   allreduce_timeout_s=10) for peer in peers[:2]]  # fmt: skip
        with monkeypatch.context() as patched:  # the averager's process is forked with the patch, and only it
            patched.setattr(reducer, "bounded_mean", thousandfold_bounded_mean)
            averagers.append(OuterAverager(peers[2].dht, "reducer", [torch.zeros(size)], quorum=1,
                                           target_group_size=3, allreduce_timeout_s=10))  # fmt: skip
        try:
            sizes: list[int] = []
            # rounds until the honest members met it MAX_OFFENCES times (under load a round may end alone), then one
            while sum(group == 3 for group in sizes[:-1]) < MAX_OFFENCES and len(sizes) < 4 * MAX_OFFENCES:
                proposals = [1 + 0.01 * torch.randn(size, generator=generator) for _ in averagers]
                outcomes = average_once(averagers, proposals, len(sizes))
                for outcome, own in zip(outcomes[:2], proposals):
                    assert outcome is not None and outcome.averaged is not None
                    gap = float((outcome.averaged[0] - own).abs().max())
                    assert gap < 0.1, (len(sizes), outcome.group_size, gap)  # honest values differ by about 0.01
                sizes.append(outcomes[0].group_size)
            assert sizes[-1] <= 2, sizes
        finally:
            for averager in averagers:
                averager.shutdown()


@pytest.mark.swarm
def test_a_member_whose_payload_is_far_smaller_than_the_others_takes_their_honest_averages() -> None:
    """Pseudo-gradients after one warm-up step against twenty steps (measured on the emulated WAN: the small one's
    unit judged an honest reducer's average implausible, then shunned it at exit): three averagers, the first's
    payload a thousand times smaller than the others'. Every member ends on the plain mean, no average is replaced
    and nobody is refused (the groups stay three)."""
    size = 400_000  # several parts of hivemind's 512 KiB: every member reduces a slice
    generator = torch.Generator().manual_seed(2)
    with record_peers(3) as peers:
        averagers = [OuterAverager(peer.dht, "small", [torch.zeros(size)], quorum=1, target_group_size=3,
                                   allreduce_timeout_s=10) for peer in peers]  # fmt: skip
        try:
            for number in range(MAX_OFFENCES + 1):
                scales = (1e-6, 1e-3, 1e-3)
                payloads = [scale * torch.randn(size, generator=generator) for scale in scales]
                outcomes = average_once(averagers, payloads, number)
                mean = torch.stack(payloads).mean(dim=0)
                for outcome in outcomes:
                    assert outcome is not None and outcome.averaged is not None and outcome.group_size == 3
                    gap = float((outcome.averaged[0] - mean).abs().max())
                    assert gap < 1e-3 * float(mean.abs().max()), (number, gap)
        finally:
            for averager in averagers:
                averager.shutdown()


def test_an_offence_is_an_invalid_part_or_one_over_offence_relative_and_a_far_part_alone_is_not() -> None:
    """A part dropped as far (e.g. because the others agree closely) is no offence by itself; an invalid part, or
    parts deviating over OFFENCE_RELATIVE × the medians' norm, is."""
    cases = {(False, True, 0.5): False, (False, True, 3.0): False, (True, False, 0.0): True,
             (False, True, OFFENCE_RELATIVE + 1): True, (False, False, OFFENCE_RELATIVE + 1): True}  # fmt: skip
    for (invalid, far, relative), offended in cases.items():
        verdict = SenderVerdict()
        result = BoundedMean(torch.zeros(1), invalid=(0,) * invalid, far=(0,) * far, excess=(5.0,),
                             deviation=(relative,), center_norm=1.0)  # fmt: skip
        verdict.add(result, 0)
        assert verdict.offended is offended, (invalid, far, relative)


def reduce_slice(
    slices: list[list[torch.Tensor]],
    weights: list[float],
    references: list[torch.Tensor] | None = None,
    own_sender: int | None = None,
) -> list[SenderVerdict]:
    """The verdicts of hivemind's reducer of one slice as this project replaces it (reducer.py), each sender's parts
    arriving as hivemind's all-reduce delivers them."""
    finished: list[list[SenderVerdict]] = []

    async def everyone() -> None:  # the reducer's futures belong to the loop it is made in
        shapes = [part.shape for part in slices[0]]
        part_reducer = reducer.BoundedPartReducer(shapes, len(slices), finished.append, references, own_sender)

        async def send(sender: int) -> None:
            for index, part in enumerate(slices[sender]):
                await part_reducer.accumulate_part(sender, index, part, weights[sender])

        await asyncio.gather(*(send(sender) for sender in range(len(slices))))
        part_reducer.finalize()

    asyncio.run(everyone())
    return finished[0]


def test_each_members_step_is_compared_with_this_units_own_over_the_slice() -> None:
    """Members' steps from the reference (φ) share a direction plus their own noise of the same size (cosine 0.5
    between two); one member sends its step flipped, of honest length, another noise of the steps' size, another a
    step a twentieth as long (a unit one step into its round). Compared with this unit's step (sender 0): the honest
    ones agree about +0.5, the flipped one about -0.5, the noisy one about 0, the short one is not judged; none of it
    is an offence in one round (that is judged over rounds: StepDirections)."""
    generator = torch.Generator().manual_seed(0)
    size, parts = 4096, 3
    reference = [torch.randn(size, generator=generator) for _ in range(parts)]
    shared = [torch.randn(size, generator=generator) for _ in range(parts)]

    def step(scale: float = 0.01) -> list[torch.Tensor]:
        return [scale * (common + torch.randn(size, generator=generator)) for common in shared]

    honest = [[r + s for r, s in zip(reference, step())] for _ in range(3)]
    flipped = [r - s for r, s in zip(reference, step())]
    noise = [r + 0.01 * 2**0.5 * torch.randn(size, generator=generator) for r in reference]
    short = [r + s for r, s in zip(reference, step(0.0005))]
    verdicts = reduce_slice([*honest, flipped, noise, short], [1.0] * 6, reference, own_sender=0)
    agreements = [verdict.agreement for verdict in verdicts]
    assert agreements[0] is None and agreements[5] is None, agreements
    assert all(0.4 < a < 0.6 for a in agreements[1:3]) and -0.6 < agreements[3] < -0.4, agreements
    assert abs(agreements[4]) < 0.05 and not any(verdict.offended for verdict in verdicts), agreements
    assert "its step's agreement with this unit's -0." in verdicts[3].summary()
    assert all(v.agreement is None for v in reduce_slice(honest, [1.0] * 3, own_sender=0)), "no reference, no judgement"


def test_a_member_pulls_against_this_unit_once_its_mean_agreement_over_rounds_is_negative() -> None:
    """StepDirections: a member is judged once DIRECTION_ROUNDS of its rounds were; an honest member's noisy rounds
    (one at -0.5) keep a positive mean; a flipped one's is negative; rounds not judged neither count nor offend."""
    directions = StepDirections()
    honest = [0.2, -0.5, 0.3, 0.25, 0.1, 0.2, -0.15, 0.3]
    assert [directions.judge("honest", a) for a in honest] == [None] * len(honest)
    flipped = [directions.judge("flipped", a) for a in (-0.3, None, -0.2, -0.4, 0.1)]
    assert flipped[:3] == [None, None, None] and "mean agreement -0.30 over its last 3 rounds" in (flipped[3] or "")
    assert "mean agreement -0.20 over its last 4 rounds" in (flipped[4] or "")
    history = StepDirections()
    assert [history.judge("x", a) for a in (-0.3,) * (DIRECTION_ROUNDS - 1)] == [None] * (DIRECTION_ROUNDS - 1)
    assert history.judge("x", None) is None and history.judge("x", -0.3) is not None


def test_a_member_that_made_more_steps_is_no_offender_where_the_median_of_a_part_is_near_zero() -> None:
    """The first round of a swarm, as measured (a chaos test's unit refused for it): two units send proposals after
    one inner step in warm-up, the third after twenty. Its slice holds a weight matrix and a bias initialised to 0,
    whose median moved only by the others' one small step: part by part, the third deviated over 100× that median's
    norm, yet over the whole slice its deviation is a small fraction of the medians' norm: no offence. The same
    member's proposal scaled a thousandfold is one."""
    generator = torch.Generator().manual_seed(0)
    weight, bias = 0.02 * torch.randn(4096, generator=generator), torch.zeros(64)

    def proposal(step_size: float) -> list[torch.Tensor]:
        return [weight + step_size * torch.randn(4096, generator=generator),
                bias + step_size * torch.randn(64, generator=generator)]  # fmt: skip

    one_step, another_step, twenty_steps = proposal(1e-5), proposal(1e-5), proposal(2e-3)
    honest = reduce_slice([one_step, another_step, twenty_steps], [256.0, 256.0, 5120.0])
    per_part = bounded_mean([one_step[1], another_step[1], twenty_steps[1]], [256.0, 256.0, 5120.0])
    assert per_part.relative[2] > 10 * OFFENCE_RELATIVE  # what the part-by-part rule judged
    assert honest[2].relative < 0.2 and not any(verdict.offended for verdict in honest), honest
    scaled = reduce_slice([one_step, another_step, [1000 * part for part in twenty_steps]], [256.0, 256.0, 5120.0])
    assert scaled[2].offended and not scaled[0].offended and not scaled[1].offended


def test_a_round_is_taken_when_most_members_declared_this_units_tag_so_one_member_cannot_veto_it() -> None:
    def outcome(tags: tuple[str, ...], position: int = 0) -> RoundOutcome:
        return RoundOutcome([torch.zeros(1)], len(tags), 0, 1.0, 0.0, 0.0, member_tags=tags, position=position)

    assert outcome(("settle", "settle", "settle", "")).tags_agree
    assert outcome(("settle", "settle", "x"), position=1).tags_agree
    assert not outcome(("settle", "x")).tags_agree  # two members: nothing tells which one lies
    assert not outcome(("x", "settle", "settle")).tags_agree  # this unit is the odd one out
    assert outcome(("settle",)).tags_agree and outcome(()).tags_agree


@pytest.mark.swarm
def test_an_all_reduce_with_parts_missing_names_the_members_that_did_not_deliver(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Three averagers, the third of which stalls while it reduces its slice: the honest members' all-reduce ends at
    its timeout, and each logs the third's peer id with the parts it did not send and the averages it did not
    return (hivemind's own warning gives only a percentage)."""
    log = tmp_path / "reducer.log"
    handler = logging.FileHandler(log)  # the forked averager processes inherit it
    handler.setFormatter(logging.Formatter("%(process)d %(message)s"))
    logging.getLogger("p2p_diloco.network.reducer").addHandler(handler)
    size = 400_000  # several parts of hivemind's 512 KiB: every member reduces a slice
    try:
        with record_peers(3) as peers:
            averagers = [OuterAverager(peer.dht, "missing", [torch.zeros(size)], quorum=1, target_group_size=3,
                                       allreduce_timeout_s=4) for peer in peers[:2]]  # fmt: skip
            with monkeypatch.context() as patched:  # only the third averager's process is forked with the patch
                patched.setattr(reducer, "bounded_mean", stalling_bounded_mean)
                averagers.append(OuterAverager(peers[2].dht, "missing", [torch.zeros(size)], quorum=1,
                                               target_group_size=3, allreduce_timeout_s=4))  # fmt: skip
            stalled = str(averagers[2]._averager.peer_id)
            try:
                for averager in averagers:
                    assert averager.begin_round([torch.ones(size)], weight=1.0, outer_round=0, window_s=3.0)
                for averager in averagers[:2]:
                    averager.finish_round(timeout_s=30.0)
            finally:
                for averager in averagers:
                    averager.shutdown()
    finally:
        logging.getLogger("p2p_diloco.network.reducer").removeHandler(handler)
        handler.close()
    naming = [line for line in log.read_text().splitlines() if "parts missing" in line and stalled in line]
    assert len(naming) >= 2, log.read_text()  # both honest members (the stalled one logs its own view)
    assert any(f"{stalled} returned 0 of" in line for line in naming), naming


def stalling_bounded_mean(*args: Any) -> BoundedMean:
    time.sleep(STALL_S)  # blocks the averager process's event loop: it neither sends nor returns anything meanwhile
    return bounded_mean(*args)


def thousandfold_bounded_mean(*args: Any, **kwargs: Any) -> BoundedMean:
    result = bounded_mean(*args, **kwargs)
    return replace(result, value=1000 * result.value)


def test_a_pair_with_a_member_that_offended_in_its_window_is_left() -> None:
    """The pair rule of ``GatedAverager._aggregate_with_group``: a group of two whose other member offended in any of
    its last OFFENCE_WINDOW rounds is left (a pair cannot bound its part); a larger group, or a member whose offences
    are older than that, is kept."""
    judge = SimpleNamespace(gate=MemberGate.everyone(), _offences={}, _directions=StepDirections())
    GatedAverager._judge(judge, {"QmNoisy": SenderVerdict(parts=3, invalid=3, dropped=3)})  # type: ignore[arg-type]
    assert GatedAverager._pairs_with_an_offender(judge, ["QmNoisy"])  # type: ignore[arg-type,list-item]
    assert not GatedAverager._pairs_with_an_offender(judge, ["QmNoisy", "QmOther"])  # type: ignore[arg-type,list-item]
    assert not GatedAverager._pairs_with_an_offender(judge, ["QmOther"])  # type: ignore[arg-type,list-item]
    for _ in range(OFFENCE_WINDOW):
        GatedAverager._judge(judge, {"QmNoisy": SenderVerdict(parts=3)})  # type: ignore[arg-type]
    assert not GatedAverager._pairs_with_an_offender(judge, ["QmNoisy"])  # type: ignore[arg-type,list-item]


def test_shutdown_cancels_the_all_reduces_in_flight() -> None:
    """hivemind 1.1.12's shutdown called ``finalize`` on the futures of its running groups (AttributeError at every
    exit with a round in flight); the mended one cancels each runner that is known and skips the others."""
    cancelled: list[bool] = []

    async def shut_down() -> None:
        known, forming, failed = (asyncio.get_running_loop().create_future() for _ in range(3))
        known.set_result(SimpleNamespace(finalize=lambda cancel: cancelled.append(cancel)))
        failed.set_exception(RuntimeError("matchmaking failed"))
        averager = SimpleNamespace(client_mode=True, _running_groups={b"a": known, b"b": forming, b"c": failed})
        await GatedAverager._shutdown(averager, timeout=None)  # type: ignore[arg-type]

    asyncio.run(shut_down())
    assert cancelled == [True]


def test_a_member_is_refused_after_max_offences_in_its_window_and_only_then() -> None:
    """The policy of ``GatedAverager._judge``: clipped or capped parts are logged only; a member that offended
    (parts dropped as invalid or far off, implausible averages) is refused once MAX_OFFENCES of its last
    OFFENCE_WINDOW rounds were offences, and never for offences further apart than that."""
    judge = SimpleNamespace(gate=MemberGate.everyone(), _offences={}, _directions=StepDirections())
    mild = SenderVerdict(parts=3, clipped=2, capped=1)
    offending = SenderVerdict(parts=3, invalid=1, dropped=1)
    for _ in range(MAX_OFFENCES + 2):
        GatedAverager._judge(judge, {"QmMild": mild})  # type: ignore[arg-type]
    assert not judge.gate.refused("QmMild")
    for _ in range(4 * MAX_OFFENCES):  # an offence once every OFFENCE_WINDOW rounds: never refused
        GatedAverager._judge(judge, {"QmRare": offending})  # type: ignore[arg-type]
        for _ in range(OFFENCE_WINDOW - 1):
            GatedAverager._judge(judge, {"QmRare": mild})  # type: ignore[arg-type]
    assert not judge.gate.refused("QmRare")
    for _ in range(MAX_OFFENCES - 1):  # every other round: refused at its MAX_OFFENCES-th offence
        assert not judge.gate.refused("QmRed")
        GatedAverager._judge(judge, {"QmRed": offending})  # type: ignore[arg-type]
        GatedAverager._judge(judge, {"QmRed": mild})  # type: ignore[arg-type]
    assert not judge.gate.refused("QmRed")
    GatedAverager._judge(judge, {"QmRed": offending})  # type: ignore[arg-type]
    assert judge.gate.refused("QmRed") and not judge.gate.refused("QmMild") and not judge.gate.refused("QmRare")


@pytest.mark.swarm
def test_a_leader_the_layout_names_is_asked_even_when_the_dht_does_not_show_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no averager declared in the DHT (as when lookups on a loaded swarm return too late), two units meet only
    because the follower asks the leader its layout names (rounds/grid.py ``row_leaders``) at once, and again when
    it asked before the leader began; the follower schedules at the time its group request names, not a window from
    its call."""

    async def declare_nothing(*_args: Any, **_kwargs: Any) -> bool:
        return True

    monkeypatch.setattr(GroupKeyManager, "declare_averager", declare_nothing)  # before the averager processes fork
    leader_dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    follower_dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                initial_peers=leader_dht.get_visible_maddrs())  # fmt: skip
    averagers = [OuterAverager(dht, "hinted", [torch.zeros(8)], quorum=1, target_group_size=2, allreduce_timeout_s=5)
                 for dht in (leader_dht, follower_dht)]  # fmt: skip
    leader, follower = averagers
    try:
        hint = (Leader(leader_dht.peer_id.to_base58(), -SPACING_S),)
        for hinted, follower_first in (((), False), (hint, False), (hint, True)):
            leader_at = time.time() + 2.5
            group = GroupRequest(leaders=hinted, scheduled_at=leader_at + SPACING_S)  # its window: until then
            if follower_first:  # asked before it began, the leader turns the follower down: it is asked again
                assert follower.begin_round([torch.ones(8)], weight=1.0, outer_round=0, window_s=60.0, group=group)
                time.sleep(0.5)
            assert leader.begin_round([torch.zeros(8)], weight=1.0, outer_round=0, window_s=leader_at - time.time())
            if not follower_first:
                assert follower.begin_round([torch.ones(8)], weight=1.0, outer_round=0, window_s=60.0, group=group)
            outcomes = [averager.finish_round(timeout_s=15) for averager in averagers]
            assert all(outcome is not None for outcome in outcomes)
            sizes = [outcome.group_size for outcome in outcomes if outcome is not None]
            assert sizes == ([2, 2] if hinted else [1, 1]), (hinted, outcomes)
    finally:
        for averager in averagers:
            averager.shutdown()
        stop_dht(follower_dht)
        stop_dht(leader_dht)


def test_hinted_leaders_add_to_what_the_dht_shows() -> None:
    first, second, third = (PeerID.from_base58(peer) for peer in PEERS)
    assert with_hinted_leaders([(first, 10.0)], [(first, 9.0), (second, 9.5)]) == [(first, 10.0), (second, 9.5)]
    assert with_hinted_leaders([], [(third, 1.0)]) == [(third, 1.0)]


@pytest.mark.swarm
def test_a_unit_the_layout_places_in_another_group_is_refused_as_a_leader_follower_or_groupmate() -> None:
    """Three averagers under one group key; the round's layout places the first two in one group and the third in
    another, but the third asks for theirs all the same (an identity declaring the key of a group it was not drawn
    into) and enforces nothing: the first two average together, never with it, and it ends alone."""
    size = 64
    with record_peers(3) as peers:
        ids = [str(peer.dht.peer_id) for peer in peers]
        averagers = [OuterAverager(peer.dht, "layout", [torch.zeros(size)], quorum=1, target_group_size=3,
                                   allreduce_timeout_s=10) for peer in peers]  # fmt: skip
        drawn = GroupRequest(members=(ids[0], ids[1]), placed=tuple(ids))
        try:
            for number in range(2):
                for averager, group, value in zip(averagers, (drawn, drawn, GroupRequest()), (0.0, 1.0, 100.0)):
                    assert averager.begin_round([torch.full((size,), value)], weight=1.0, outer_round=number,
                                                window_s=3.0, group=group)  # fmt: skip
                outcomes = [averager.finish_round(timeout_s=30.0) for averager in averagers]
                for outcome in outcomes[:2]:
                    assert outcome is not None and outcome.averaged is not None and outcome.group_size == 2, outcome
                    assert torch.allclose(outcome.averaged[0], torch.full((size,), 0.5))
                assert outcomes[2] is None or outcomes[2].group_size == 1, outcomes[2]
        finally:
            for averager in averagers:
                averager.shutdown()
