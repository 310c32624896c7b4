"""LearningUnit's outer rounds, join and exit against in-memory network fakes (tests/fakes.py), with the real
tiny model, corpus, inner trainer, checkpoints and metrics log. No network, no processes, no threads."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from fakes import FakeAverager, FakeGroup, FakeRecords, FaultPlan, clone_all
from transformers import AutoModelForCausalLM
from unit_peers import (
    SYNC_DATA_PARALLEL,
    TOKENS_PER_STEP,
    Peer,
    PeerFactory,
    inner_step,
    maybe_begin,
    poll,
    sent_round,
    set_rounds,
    train_until_round,
)

from p2p_diloco.checkpoint import load_checkpoint, save_checkpoint
from p2p_diloco.diloco import (
    merge_local_progress,
    outer_step,
    probe_drift,
    pseudo_gradient,
    weighted_average,
)
from p2p_diloco.network.records import PeerProgress
from p2p_diloco.network.state_sync import SwarmState
from p2p_diloco.rounds.averager import GroupRequest
from p2p_diloco.rounds.departure import TOGETHER_BITS, Phase, settle_patience
from p2p_diloco.unit import joining
from p2p_diloco.unit.events import (
    ConsensusRound,
    Eval,
    LocalReset,
    OuterRound,
    OuterRoundBegin,
    OuterRoundFailed,
    StateDownload,
    Stop,
)
from p2p_diloco.unit.goodput import GoodputLedger
from p2p_diloco.unit.joining import JoinError, loss_refusal, swarm_round
from p2p_diloco.unit.unit import LEFT_TTL_S, PROGRESS_TTL_S


# ---------------------------------------------------------------------------------------------- helpers
def assert_all_close(actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> None:
    assert len(actual) == len(expected)
    for a, b in zip(actual, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def assert_all_equal(actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> None:
    assert len(actual) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(actual, expected))


def assert_round_changed_nothing(
    peer: Peer, phi: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor], theta: Sequence[torch.Tensor]
) -> None:
    """A rejected first round: φ, momentum, θ and the round unchanged, its two steps' tokens carried over."""
    unit = peer.unit
    assert_all_equal(unit.state.global_params, phi)
    assert_all_equal(unit.state.momentum, momentum)
    assert_all_equal(unit.trainer.local_parameters(), theta)
    assert unit.outer_round == 0 and sent_round(unit.engine, 0) is None
    assert unit.state.fragments[0].tokens_since_round == 2 * TOKENS_PER_STEP


def saved_ledger(peer: Peer) -> GoodputLedger:
    return GoodputLedger.model_validate_json(peer.unit.ledger_path.read_text())


def differs(first: Sequence[torch.Tensor], second: Sequence[torch.Tensor]) -> bool:
    return any(not torch.equal(a, b) for a, b in zip(first, second))


def progress(peer_id: str, outer_round: int, fingerprint: str) -> PeerProgress:
    return PeerProgress(
        peer_id=peer_id,
        inner_step=10 * outer_round,
        outer_round=outer_round,
        tokens_per_s=100.0,
        loss=3.0,
        last_seen=1.0,
        group_size=2,
        model_fingerprint=fingerprint,
    )


# ------------------------------------------------------------------------------------------------ rounds
def test_h1_lr1_no_momentum_one_group_equals_synchronous_data_parallel(make_peer: PeerFactory) -> None:
    group = FakeGroup()
    peers = [make_peer(name, group, **SYNC_DATA_PARALLEL) for name in ("a", "b")]
    a, b = peers
    assert_all_equal(a.unit.state.global_params, b.unit.state.global_params)
    for round_index in range(3):
        phi = clone_all(a.unit.state.global_params)
        local = []
        for peer in peers:
            inner_step(peer)
            local.append(peer.unit.trainer.local_parameters())
        assert differs(local[0], local[1])  # the units trained on different data
        assert [maybe_begin(peer) for peer in peers] == [True, True]
        assert [poll(peer) for peer in peers] == [True, True]
        inner_updates = [pseudo_gradient(theta, phi) for theta in local]  # θ_i − φ
        expected = [p + (ua + ub) / 2 for p, ua, ub in zip(phi, *inner_updates)]
        for peer in peers:
            assert_all_close(peer.unit.state.global_params, expected)
            assert len(peer.averager.begun[-1].proposal) == len(phi)  # φ' alone: m is never used at momentum 0
            assert_all_equal(peer.unit.trainer.local_parameters(), peer.unit.state.global_params)  # no overlap: θ = φ
            assert peer.unit.outer_round == round_index + 1
            assert peer.unit.state.fragments[0].tokens_since_round == 0
        assert_all_equal(a.unit.state.global_params, b.unit.state.global_params)
    assert [begun.weight for begun in a.averager.begun] == [TOKENS_PER_STEP] * 3


def test_late_outcome_keeps_the_overlapped_inner_steps(make_peer: PeerFactory) -> None:
    group = FakeGroup()
    a, b = make_peer("a", group), make_peer("b", group)
    for _ in range(2):
        inner_step(a)
    theta_sent = a.unit.trainer.local_parameters()
    assert maybe_begin(a)
    overlap = 3
    for _ in range(overlap):  # the partner is late: a keeps training while its round is in flight
        inner_step(a)
        assert not poll(a)
        assert not maybe_begin(a)
    theta_now = a.unit.trainer.local_parameters()
    train_until_round(b)
    assert poll(a) and poll(b)

    count = len(a.unit.state.global_params)
    sent = group.rounds[-1]
    averaged = weighted_average(
        [sent[member].proposal for member in (a.averager, b.averager)], [2 * TOKENS_PER_STEP] * 2
    )
    assert_all_close(a.unit.state.global_params, averaged[:count])
    assert_all_close(a.unit.state.momentum, averaged[count:])
    assert_all_equal(a.unit.state.global_params, b.unit.state.global_params)
    expected_theta = merge_local_progress(a.unit.state.global_params, theta_now, theta_sent)
    assert_all_close(a.unit.trainer.local_parameters(), expected_theta)
    assert differs(a.unit.trainer.local_parameters(), a.unit.state.global_params)  # the overlapped steps were kept
    assert_all_equal(b.unit.trainer.local_parameters(), b.unit.state.global_params)  # b had no overlap
    assert a.events(OuterRound)[-1].overlap_steps == overlap
    assert a.unit.state.fragments[0].steps_since_round == 0  # the next round starts H steps after this one ended


def test_failed_round_keeps_phi_and_round_and_carries_its_tokens(make_peer: PeerFactory) -> None:
    group = FakeGroup(FaultPlan().fail("a", call=0))
    a = make_peer("a", group)
    phi0, momentum0 = clone_all(a.unit.state.global_params), clone_all(a.unit.state.momentum)
    train_until_round(a)
    theta = a.unit.trainer.local_parameters()
    assert poll(a)
    assert_round_changed_nothing(a, phi0, momentum0, theta)
    assert a.events(OuterRoundFailed)[-1].error == "FakeGroup: quorum not reached"
    assert a.events(OuterRoundFailed)[-1].status == "failed"
    for _ in range(2):
        inner_step(a)
    theta4 = a.unit.trainer.local_parameters()
    assert maybe_begin(a)
    assert [begun.weight for begun in a.averager.begun] == [2 * TOKENS_PER_STEP, 4 * TOKENS_PER_STEP]
    assert poll(a)
    # alone in its group, the unit takes its own outer step on the pseudo-gradient of all four inner steps
    expected_phi, expected_momentum = outer_step(
        phi0, momentum0, pseudo_gradient(phi0, theta4), a.unit.engine.plan.step.hyper
    )
    assert_all_close(a.unit.state.global_params, expected_phi)
    assert_all_close(a.unit.state.momentum, expected_momentum)
    assert a.unit.outer_round == 1 and a.unit.state.fragments[0].tokens_since_round == 0


def test_non_finite_average_is_rejected_like_a_failed_round(make_peer: PeerFactory) -> None:
    group = FakeGroup()
    a = make_peer("a", group)
    template = [*a.unit.state.global_params, *a.unit.state.momentum]
    rogue = group.averager(template)  # a member whose proposal carries a NaN into the average
    phi0, momentum0 = clone_all(a.unit.state.global_params), clone_all(a.unit.state.momentum)
    train_until_round(a)
    theta = a.unit.trainer.local_parameters()
    poisoned = clone_all(template)
    poisoned[0].view(-1)[0] = float("nan")
    rogue.begin_round(poisoned, weight=TOKENS_PER_STEP, outer_round=0, window_s=1.0)
    assert poll(a)
    assert_round_changed_nothing(a, phi0, momentum0, theta)
    assert len(a.events(OuterRoundFailed)) == 1 and not a.events(OuterRound)
    assert not a.state_server.published  # nothing new to serve


def test_a_diverged_unit_never_sends_a_non_finite_proposal(make_peer: PeerFactory) -> None:
    b = make_peer("b", FakeGroup(), outer__inner_steps=1)
    inner_step(b)
    poisoned = b.unit.trainer.local_parameters()
    poisoned[0].view(-1)[0] = float("nan")  # e.g. an inf gradient times clip coefficient 0
    b.unit.trainer.load_parameters(poisoned)
    for _ in range(3):
        maybe_begin(b)
        poll(b)
        inner_step(b)
    assert all(torch.isfinite(tensor).all() for begun in b.averager.begun for tensor in begun.proposal)
    assert b.averager.begun and b.events(LocalReset)


def test_round_after_merge_is_the_largest_member_round_plus_one(make_peer: PeerFactory) -> None:
    group = FakeGroup()
    a, b = make_peer("a", group), make_peer("b", group)
    set_rounds(a, [3])
    set_rounds(b, [5])
    b.unit.state.global_params = [tensor + 0.01 for tensor in b.unit.state.global_params]  # b's φ drifted from a's
    drift = probe_drift([peer.unit.state.probe() for peer in (a, b)])
    assert drift > 0
    train_until_round(a)
    train_until_round(b)
    assert poll(a) and poll(b)
    assert [begun.outer_round for begun in group.rounds[-1].values()] == [3, 5]
    assert a.unit.outer_round == b.unit.outer_round == 6
    assert a.events(OuterRound)[-1].outer_round == 6
    assert a.events(OuterRound)[-1].member_drift == pytest.approx(drift)
    assert a.state_server.published[-1].outer_round == 6  # the merged state is what joiners download
    assert a.records.fingerprints == [a.unit.loaded.fingerprint]


def test_run_begins_a_round_every_h_steps(make_peer: PeerFactory) -> None:
    a = make_peer("a", FakeGroup(), run__max_steps=6, outer__inner_steps=2)
    a.unit.run(threading.Event())
    # instant solo rounds: begun after steps 2 and 5, merged at the next poll (steps 3 and 6); the step that
    # overlapped a round counts in the next round's tokens but the next round starts H steps after the merge
    assert a.unit.inner_step == 6 and a.unit.outer_round == 2 and sent_round(a.unit.engine, 0) is None
    assert [begun.weight for begun in a.averager.begun] == [2 * TOKENS_PER_STEP, 3 * TOKENS_PER_STEP]
    assert [event.overlap_steps for event in a.events(OuterRound)] == [1, 1]
    assert a.records.progress["a"].inner_step >= 1


def test_the_warm_up_rounds_come_after_a_quarter_then_half_of_h_steps_then_every_h(make_peer: PeerFactory) -> None:
    a = make_peer("a", FakeGroup(), run__max_steps=20, outer__inner_steps=4, outer__warmup_rounds=2)
    a.unit.run(threading.Event())
    begun_at = [begin.inner_step for begin in a.events(OuterRoundBegin)]
    # as above: a round begins H_r steps after the previous one merged, one step after it began; H_r = 1, 2, 4, 4, ...
    assert begun_at[:5] == [1, 4, 9, 14, 19]
    assert [event.overlap_steps for event in a.events(OuterRound)][:4] == [1, 1, 1, 1]


def test_the_unit_counts_the_live_units_and_stops_at_its_wall_clock_time(make_peer: PeerFactory) -> None:
    a = make_peer("a", FakeGroup(), run__max_steps=1, run__stop_at=time.time() + 3600)
    for other in ("b", "c"):
        a.records.publish_progress(progress(other, 0, a.unit.loaded.fingerprint))
    a.records.publish_progress(progress("d", 0, a.unit.loaded.fingerprint).copy(update={"phase": "left"}))
    a.unit.run(threading.Event())
    assert a.unit.engine.swarm_size == 3 and a.unit.inner_step == 1  # b, c and its own record; d left
    past = make_peer("past", FakeGroup(), run__stop_at=time.time() - 1)
    past.unit.run(threading.Event())
    assert past.unit.inner_step == 0, "a stop time already past: no training"


def test_an_eval_is_left_out_of_the_step_period(make_peer: PeerFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step period sizes matchmaking windows: an eval between two steps (here one that takes 1000 s of the
    monotonic clock) does not lengthen it (counted, the averaged period would pass 100 s)."""
    a = make_peer("a", FakeGroup(), outer__inner_steps=100)
    inner_step(a)
    inner_step(a)
    real_monotonic, skipped = time.monotonic, [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: real_monotonic() + skipped[0])
    evaluate = a.unit.trainer.evaluate

    def slow_evaluate(batches: Sequence[torch.Tensor]) -> float:
        skipped[0] += 1000.0
        return evaluate(batches)

    monkeypatch.setattr(a.unit.trainer, "evaluate", slow_evaluate)
    a.unit._evaluate("join")  # at once
    a.unit._evaluate("outer_round")  # spread: its one batch after the next step
    a.unit.stepped(a.unit.train_step(a.batches))
    inner_step(a)
    assert skipped[0] == 2000.0 and len(a.events(Eval)) == 2
    step_time_s = a.unit.throughput.step_time_s
    assert step_time_s is not None and step_time_s < 10.0


def test_a_processs_first_step_is_left_out_of_the_step_time(make_peer: PeerFactory) -> None:
    """The first inner step of a process (allocations, first kernels) is no measure of its speed: measured 1.4 s
    against 0.07 s after it, it had set a 32 s round period that the demo's units adopted from each other."""
    a = make_peer("a", FakeGroup(), outer__inner_steps=100)
    a.unit.train_step(a.batches)
    assert a.unit.throughput.step_time_s is None
    a.unit.train_step(a.batches)
    assert a.unit.throughput.step_time_s is not None


def test_an_eval_after_a_round_is_spread_over_the_next_steps_and_scores_phi_as_it_was(make_peer: PeerFactory) -> None:
    """One held-out batch after each inner step; the loss is that of φ when the eval began, even when φ moved
    meanwhile (a merge), and equals an eval of it at once."""
    a = make_peer("a", FakeGroup(), data__eval_batches=3, outer__inner_steps=100)
    inner_step(a)
    phi = clone_all(a.unit.state.global_params)
    with a.unit.trainer.parameters_swapped(phi):
        expected = a.unit.trainer.evaluate(a.unit.evaluator.batches)
    a.unit._evaluate("outer_round")
    for tensor in a.unit.state.global_params:
        tensor.add_(0.5)  # φ moves (a merge) while the eval runs
    for _ in range(2):
        a.unit.stepped(a.unit.train_step(a.batches))
    assert not a.events(Eval), "three batches take three steps"
    a.unit.stepped(a.unit.train_step(a.batches))
    (event,) = a.events(Eval)
    assert event.reason == "outer_round" and event.outer_round == 0
    assert event.eval_loss == pytest.approx(expected, rel=1e-6)
    assert a.unit.evaluator.last_loss == event.eval_loss


def test_an_eval_or_export_reads_phi_where_it_lies_and_leaves_theta(make_peer: PeerFactory) -> None:
    """Swapping φ into the model for an eval or an export copies nothing when φ has the parameters' dtype and device
    (a copy of the model less at every eval and at exit), converts it otherwise, and puts θ back after."""
    a = make_peer("a", FakeGroup())
    inner_step(a)
    trainer, phi = a.unit.trainer, a.unit.state.global_params
    theta = trainer.local_parameters()
    assert differs(theta, phi)
    with trainer.parameters_swapped(phi):
        assert [param.data_ptr() for param in trainer.params] == [tensor.data_ptr() for tensor in phi]
    assert_all_equal(trainer.local_parameters(), theta)
    halves = [tensor.to(torch.bfloat16) for tensor in phi]
    with trainer.parameters_swapped(halves):
        assert all(param.dtype == torch.float32 for param in trainer.params)
        assert_all_equal(trainer.local_parameters(), [half.float() for half in halves])
    assert_all_equal(trainer.local_parameters(), theta)


def test_a_processs_first_merged_round_writes_the_checkpoint_then_every_n_rounds(make_peer: PeerFactory) -> None:
    """A kill after a unit's first merged round loses at most one round of its own work: the first round a process
    advances writes the checkpoint whatever checkpoint_every_rounds says; after it, every N rounds."""
    a = make_peer("a", FakeGroup(), run__checkpoint_every_rounds=3)
    written = []
    for _ in range(3):
        train_until_round(a)
        assert poll(a)
        checkpoint = load_checkpoint(a.unit.checkpoint_path)
        written.append(None if checkpoint is None else checkpoint["outer_round"])
    assert written == [1, 1, 3]


def test_the_final_eval_drops_a_spread_eval_still_running(make_peer: PeerFactory) -> None:
    """At exit the final φ supersedes the φ of a spread eval not finished yet: only the final eval is written."""
    a = make_peer("a", FakeGroup(), data__eval_batches=3, outer__inner_steps=100)
    inner_step(a)
    a.unit._evaluate("outer_round")
    a.unit.stepped(a.unit.train_step(a.batches))
    a.unit._evaluate("final")
    assert [event.reason for event in a.events(Eval)] == ["final"] and a.unit.evaluator.running is None


# -------------------------------------------------------------------------------------------------- join
def test_join_adopts_the_swarm_state_of_a_later_round(make_peer: PeerFactory) -> None:
    template = make_peer("template", FakeGroup()).unit
    generator = torch.Generator().manual_seed(1)
    phi = [torch.randn(t.shape, generator=generator) * 0.02 for t in template.state.global_params]
    momentum = [torch.randn(t.shape, generator=generator) * 1e-3 for t in template.state.global_params]
    served = SwarmState(phi, momentum, fragment_rounds=[7], inner_step=140, tokens=9000)
    records = FakeRecords({"donor": progress("donor", 7, template.loaded.fingerprint)})
    a = make_peer("a", FakeGroup(), records=records, served=served)
    assert a.unit.join() == "swarm"
    assert a.state_server.downloads == 1
    assert_all_equal(a.unit.state.global_params, phi)
    assert_all_equal(a.unit.state.momentum, momentum)
    assert a.unit.outer_round == 7
    assert_all_equal(a.unit.trainer.local_parameters(), phi)
    assert a.state_server.published[-1].outer_round == 7  # it serves the adopted state at once
    assert a.events(StateDownload)[-1].outer_round == 7


def test_join_believes_a_donor_record_fresher_than_the_progress_records(make_peer: PeerFactory) -> None:
    """The progress records (every 10 s) still say round 0 while the donors already declare round 4: the joiner
    downloads the state rather than training from the initial weights (seen in a swarm test right after a join)."""
    template = make_peer("template", FakeGroup()).unit
    served = SwarmState(clone_all(template.state.global_params), clone_all(template.state.momentum), [4], 40, 0)
    records = FakeRecords({"donor": progress("donor", 0, template.loaded.fingerprint)})
    a = make_peer("a", FakeGroup(), records=records, served=served)
    assert a.unit.join() == "swarm" and a.unit.outer_round == 4 and a.state_server.downloads == 1


def test_the_swarm_round_counts_donor_records_only_of_units_that_publish_progress() -> None:
    """A unit's donor record raises its progress claim; donor records of identities that publish no progress (a
    flood of them, or a red unit whose progress records are refused) do not count, however many there are."""
    records = {peer: progress(peer, 0, "f") for peer in ("a", "b")}
    assert swarm_round(records, {"a": 4, "b": 3}, peer_id="joiner") == 4
    flood = {"red": 10**6, **{f"sybil-{index}": 10**6 + 4 for index in range(8)}}
    assert swarm_round(records, flood, peer_id="joiner") == 0
    assert swarm_round(records, {"a": 4, "joiner": 9}, peer_id="joiner") == 4
    assert swarm_round({}, flood, peer_id="joiner") == -1


def test_a_unit_at_momentum_zero_keeps_serves_and_checkpoints_no_momentum(make_peer: PeerFactory) -> None:
    """At outer momentum 0, m would never be read: the unit holds none (4 bytes per parameter less, and as many in its
    state server), merges rounds without it, checkpoints and serves none, and drops a downloaded state's momentum."""
    donor = make_peer("donor", FakeGroup())  # keeps a momentum (0.9)
    served = SwarmState(clone_all(donor.unit.state.global_params),
                        [torch.ones_like(t) for t in donor.unit.state.global_params], [4], 0, 0)  # fmt: skip
    records = FakeRecords({"donor": progress("donor", 4, donor.unit.loaded.fingerprint)})
    a = make_peer("a", FakeGroup(), records=records, served=served, outer__outer_momentum=0.0)
    assert a.unit.state.momentum == []
    assert a.unit.join() == "swarm" and a.unit.state.momentum == []
    phi = clone_all(a.unit.state.global_params)
    train_until_round(a)
    theta = clone_all(sent_round(a.unit.engine, 0).local_at_send)
    assert sent_round(a.unit.engine, 0).momentum_proposal == []
    assert poll(a)  # alone: φ ← its own proposal φ − lr·(φ − θ)
    lr = a.unit.engine.plan.step.hyper.lr
    assert_all_close(a.unit.state.global_params, [p - lr * (p - t) for p, t in zip(phi, theta)])
    assert a.unit.state.momentum == [] and a.state_server.published[-1].momentum == []
    a.unit.save()
    checkpoint = load_checkpoint(a.unit.checkpoint_path)
    assert checkpoint is not None and checkpoint["momentum"] == []
    with_momentum = make_peer("a", FakeGroup())  # the same work dir, now at momentum 0.9: m starts at zero
    assert with_momentum.unit.join() == "checkpoint"
    assert_all_equal(with_momentum.unit.state.momentum, [torch.zeros_like(t) for t in phi])


def test_join_alone_starts_from_the_initial_weights(make_peer: PeerFactory) -> None:
    a = make_peer("a", FakeGroup())
    initial = clone_all(a.unit.state.global_params)
    a.records.publish_progress(progress("a", 9, a.unit.loaded.fingerprint))  # its own stale record is ignored
    assert a.unit.join() == "initial weights"
    assert a.state_server.downloads == 0
    assert_all_equal(a.unit.state.global_params, initial)
    assert a.unit.outer_round == 0 and a.state_server.published[-1].outer_round == 0


class UnreadableAtFirst(FakeRecords):
    """Progress records the first ``unreadable`` reads miss (a DHT get that failed, units too busy to answer)."""

    def __init__(self, records: dict[str, PeerProgress], unreadable: int):
        super().__init__(records)
        self.unreadable, self.reads = unreadable, 0

    def read_progress(self) -> dict[str, PeerProgress]:
        self.reads += 1
        return {} if self.reads <= self.unreadable else super().read_progress()


@pytest.fixture
def quick_rereads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A joiner's rereads of unreadable records (joining.py ``swarm_round_seen``) every 10 ms for at most 1 s."""
    monkeypatch.setattr(joining, "SEEN_RETRY_S", 0.01)
    monkeypatch.setattr(joining, "SEEN_WAIT_S", 1.0)


@pytest.mark.parametrize("swarm_seen, source", [(True, "swarm"), (False, "initial weights")])
@pytest.mark.usefixtures("quick_rereads")
def test_a_joiner_that_knows_a_unit_came_first_rereads_records_it_could_not_read(
    make_peer: PeerFactory, monkeypatch: pytest.MonkeyPatch, swarm_seen: bool, source: str
) -> None:
    """The third SmolLM2 unit of issue 36 trained from the initial weights while the swarm was at round 2: a joiner
    whose run's model record was published by another unit reads the records again before it believes round 0."""
    first = make_peer("first", FakeGroup())
    served = SwarmState(clone_all(first.unit.state.global_params), [], [2], 20, 0)
    records = UnreadableAtFirst({"first": progress("first", 2, first.unit.loaded.fingerprint)}, unreadable=3)
    joiner = make_peer("joiner", FakeGroup(), records=records, served=served, outer__outer_momentum=0.0)
    monkeypatch.setattr(joiner.state_server, "declared_rounds", dict)  # the donor records unreadable too
    assert joiner.unit.join(swarm_seen=swarm_seen) == source
    assert records.reads == (5 if swarm_seen else 1)  # 3 missed, 1 read, 1 to judge the state downloaded


@pytest.mark.usefixtures("quick_rereads")
def test_a_joiner_says_why_it_starts_from_the_initial_weights_after_another_unit(
    make_peer: PeerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    joiner = make_peer("joiner", FakeGroup())
    with caplog.at_level(logging.WARNING, logger="p2p_diloco"):
        assert joiner.unit.join(swarm_seen=True) == "initial weights"
    assert "another unit joined this run before" in caplog.text


@pytest.mark.usefixtures("quick_rereads")
def test_a_joiner_takes_the_donors_state_when_no_unit_publishes_progress_for_a_while(
    make_peer: PeerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Units busy for longer than their progress records live still serve their state (forked state servers)."""
    first = make_peer("first", FakeGroup())
    served = SwarmState(clone_all(first.unit.state.global_params), [], [2], 20, 0)
    joiner = make_peer("joiner", FakeGroup(), served=served, outer__outer_momentum=0.0)
    with caplog.at_level(logging.WARNING, logger="p2p_diloco"):
        assert joiner.unit.join(swarm_seen=True) == "swarm" and joiner.unit.outer_round == 2
    assert "donors declare outer round 2" in caplog.text
    alone = make_peer("alone", FakeGroup(), served=served, outer__outer_momentum=0.0)
    assert alone.unit.join(swarm_seen=False) == "initial weights"  # donor records alone: not believed (donor-flood)


def test_a_units_last_record_outlives_it_for_minutes_and_claims_no_round(make_peer: PeerFactory) -> None:
    """``status`` shows a finished run's last records for LEFT_TTL_S; a joiner does not try to download the state of
    units that left (nobody serves it)."""
    a = make_peer("a", FakeGroup())
    a.unit.publish("training", wait=False)
    a.unit.publish("left", wait=True)
    assert a.records.lifetimes == [PROGRESS_TTL_S, LEFT_TTL_S] and LEFT_TTL_S >= 300
    records = FakeRecords({"gone": progress("gone", 5, a.unit.loaded.fingerprint).copy(update={"phase": "left"})})
    joiner = make_peer("joiner", FakeGroup(), records=records)
    assert joiner.unit.join() == "initial weights" and joiner.state_server.downloads == 0


def test_a_state_whose_loss_no_live_unit_reports_is_refused() -> None:
    assert loss_refusal(6.5, 6.2, "the median") is None
    assert loss_refusal(73.5, 6.2, "the median the live units report (3 units)") == (
        "its held-out loss 73.5 is over 1.5 x the median the live units report (3 units) (6.2)"
    )
    assert loss_refusal(math.nan, 6.2, "the median") is not None


def joiner_served(make_peer: PeerFactory, records: dict[str, PeerProgress], served: SwarmState) -> Peer:
    """A joiner reading ``records`` whose donor (peer ``donor``) serves ``served``; its join times out after 1 s."""
    return make_peer("joiner", FakeGroup(), records=FakeRecords(records), served=served, outer__outer_momentum=0.0,
                     network__join_timeout_s=1.0)  # fmt: skip


def assert_refuses_the_donor(joiner: Peer) -> None:
    with pytest.raises(JoinError, match="states refused: those of donor"):
        joiner.unit.join()


@pytest.mark.parametrize("reported", [True, False])
@pytest.mark.parametrize("forged", [False, True])
def test_a_joiner_judges_the_state_two_donors_agree_on_by_its_loss(
    make_peer: PeerFactory, forged: bool, reported: bool
) -> None:
    """Issue 37: two identities serving the same forged state at a believable round corroborate each other; the joiner
    evaluates it and compares with the eval losses the other live units' records report, or, where none reports one
    (a swarm's start, where a lone donor's state is taken uncorroborated), with its own starting weights' loss."""
    first = make_peer("first", FakeGroup())
    honest = first.unit.ranks.evaluate(first.unit.trainer, first.unit.state.global_params, first.unit.evaluator.batches)
    phi = clone_all(first.unit.state.global_params)
    if forged:
        phi = [tensor + 3.0 * torch.randn_like(tensor) for tensor in phi]
    served = SwarmState(phi, [], [2], 20, 0)
    fingerprint = first.unit.loaded.fingerprint
    reports = {name: progress(name, 2, fingerprint).copy(update={"eval_loss": honest if reported else None})
               for name in ("u1", "u2")}  # fmt: skip
    joiner = joiner_served(make_peer, reports, served)
    if forged:
        assert_refuses_the_donor(joiner)
        return
    assert joiner.unit.join() == "swarm"
    assert joiner.unit._join_loss == pytest.approx(honest, rel=1e-6)  # evaluated once, kept for the join eval


@pytest.mark.parametrize("other_claims", [False, True])
def test_a_lone_donor_whose_state_is_refused_leaves_the_joiner_its_own_weights(
    make_peer: PeerFactory, other_claims: bool
) -> None:
    """A swarm's start beside one liar (red team ``state-far-ahead``: random tensors declared at round 10^6): its state
    is refused against the joiner's own starting weights; with no other unit claiming a round, the joiner starts from
    its own weights (before, every unit starting beside it took the state: eval 69.3 at join); with another unit
    claiming one, the join fails as before (JoinError naming the refused donor)."""
    first = make_peer("first", FakeGroup())
    forged = [torch.randn_like(tensor) * 3.0 for tensor in first.unit.state.global_params]
    fingerprint = first.unit.loaded.fingerprint
    records = {"donor": progress("donor", 0, fingerprint)}
    if other_claims:
        records["honest"] = progress("honest", 3, fingerprint)
    joiner = joiner_served(make_peer, records, SwarmState(forged, [], [10**6], 0, 0))
    if other_claims:
        assert_refuses_the_donor(joiner)
        return
    assert joiner.unit.join() == "initial weights" and joiner.unit.outer_round == 0
    assert_all_equal(joiner.unit.state.global_params, first.unit.state.global_params)
    own = first.unit.ranks.evaluate(first.unit.trainer, first.unit.state.global_params, first.unit.evaluator.batches)
    assert joiner.unit._join_loss == pytest.approx(own, rel=1e-6)  # its join eval: its own weights', not the refused


def test_join_resumes_a_checkpoint_newer_than_the_swarm(make_peer: PeerFactory) -> None:
    first = make_peer("a", FakeGroup())
    train_until_round(first)
    assert poll(first)
    inner_step(first)  # θ ≠ φ in the checkpoint
    set_rounds(first, [5])
    first.unit.save()
    records = FakeRecords({"donor": progress("donor", 3, first.unit.loaded.fingerprint)})
    served = SwarmState(clone_all(first.unit.state.global_params), clone_all(first.unit.state.momentum), [3], 0, 0)
    again = make_peer("a", FakeGroup(), records=records, served=served)
    assert again.unit.join() == "checkpoint"
    assert again.state_server.downloads == 0
    assert again.unit.outer_round == 5 and again.unit.inner_step == 3 and again.unit.tokens == 3 * TOKENS_PER_STEP
    assert_all_equal(again.unit.state.global_params, first.unit.state.global_params)
    assert_all_equal(again.unit.state.momentum, first.unit.state.momentum)
    assert_all_equal(again.unit.trainer.local_parameters(), first.unit.trainer.local_parameters())


def test_join_prefers_a_swarm_ahead_of_the_checkpoint(make_peer: PeerFactory) -> None:
    first = make_peer("a", FakeGroup())
    set_rounds(first, [2])
    first.unit.save()
    served = SwarmState(clone_all(first.unit.state.global_params), clone_all(first.unit.state.momentum), [4], 0, 0)
    records = FakeRecords({"donor": progress("donor", 4, first.unit.loaded.fingerprint)})
    again = make_peer("a", FakeGroup(), records=records, served=served)
    assert again.unit.join() == "swarm" and again.unit.outer_round == 4


def test_join_refuses_a_checkpoint_of_another_model(make_peer: PeerFactory) -> None:
    a = make_peer("a", FakeGroup())
    save_checkpoint(a.unit.checkpoint_path, {"model_fingerprint": "0" * 16, "outer_round": 1})
    with pytest.raises(JoinError, match="another model"):
        a.unit.join()


def test_join_fails_when_no_live_peer_serves_the_state(make_peer: PeerFactory) -> None:
    records = FakeRecords()
    a = make_peer("a", FakeGroup(), records=records, network__join_timeout_s=0.01)
    records.publish_progress(progress("donor", 2, a.unit.loaded.fingerprint))
    with pytest.raises(JoinError, match="outer round 2"):
        a.unit.join()


# ------------------------------------------------------------------------------------------------ finish
def test_finish_hands_the_last_steps_to_a_final_round_then_checkpoints_and_exports(
    make_peer: PeerFactory, tmp_path: Path
) -> None:
    save_dir = tmp_path / "export"
    a = make_peer("a", FakeGroup(), run__save_dir=str(save_dir))
    train_until_round(a)
    assert poll(a)
    inner_step(a)
    phi_before, theta = clone_all(a.unit.state.global_params), a.unit.trainer.local_parameters()
    assert differs(theta, phi_before)
    a.unit.finish()

    final = a.averager.begun[-1]  # the one-step progress went into a last round (alone here: quorum 1)
    assert a.unit.outer_round == 2 and final.weight == TOKENS_PER_STEP and sent_round(a.unit.engine, 0) is None
    assert differs(a.unit.state.global_params, phi_before)
    checkpoint = load_checkpoint(a.unit.checkpoint_path)
    assert checkpoint is not None
    assert checkpoint["model_fingerprint"] == a.unit.loaded.fingerprint and checkpoint["outer_round"] == 2
    assert_all_equal(checkpoint["global_params"], a.unit.state.global_params)
    assert_all_equal(checkpoint["local_params"], a.unit.trainer.local_parameters())  # exporting φ left θ in place
    assert (save_dir / "model.safetensors").exists()
    exported = AutoModelForCausalLM.from_pretrained(save_dir)
    assert_all_equal([p.detach() for p in exported.parameters() if p.requires_grad], a.unit.state.global_params)
    stop = a.events(Stop)[-1]
    assert stop.outer_round == 2 and math.isfinite(stop.eval_loss)
    ledger = a.unit.ledger  # every step was merged: all its compute is useful
    assert stop.useful_compute_s == ledger.useful_compute_s == pytest.approx(ledger.compute_s)
    assert stop.compute_s == ledger.compute_s and stop.useful_tokens == 3 * TOKENS_PER_STEP
    assert stop.allocated_s > 0 and stop.goodput == pytest.approx(ledger.useful_compute_s / stop.allocated_s)
    assert saved_ledger(a) == ledger


def test_finish_hands_the_steps_made_while_a_round_was_in_flight_to_one_more_final_round(
    make_peer: PeerFactory,
) -> None:
    a = make_peer("a", FakeGroup())
    train_until_round(a)  # its round ended (alone: quorum 1) but is not merged yet: in flight at exit
    inner_step(a)
    a.unit.finish()
    assert [round.weight for round in a.averager.begun] == [2 * TOKENS_PER_STEP, TOKENS_PER_STEP]
    assert a.unit.outer_round == 2 and a.unit.state.fragments[0].tokens_since_round == 0
    assert a.events(Stop)[-1].useful_tokens == 3 * TOKENS_PER_STEP


@pytest.mark.parametrize(
    ("others", "waits", "leaves_together"),
    [({}, False, True), (None, False, False), ({"b": "finishing"}, True, True),
     ({"suspect": "finishing"}, False, True), ({"b": "training"}, False, False), ({"b": "left"}, False, True)],
    ids=["alone in the swarm", "live units unread", "another unit finishes", "a suspect finishes",
         "the others train on", "the other unit left"],
)  # fmt: skip
def test_a_lone_settle_round_is_retried_only_while_another_unit_finishes(
    make_peer: PeerFactory, others: dict[str, Phase] | None, waits: bool, leaves_together: bool
) -> None:
    """Settle rounds that meet nobody go on while the census holds another unit that is finishing and that the settle
    rounds admit (--settle-rounds, then as many as fit in the final rounds' bound, which that unit may still be
    waiting out); otherwise one round, and none when no unit trains on and the final round held every unit leaving
    (this one alone; not while live units of the census while training are missing from the reads). The unit
    announces that it finishes, refreshes that each settle round, then announces that it left."""
    settle = FakeGroup()  # only this unit's settle averager: every settle round is alone
    a = make_peer("a", FakeGroup(), settle_group=settle, outer__settle_rounds=4, outer__min_window_s=0.25)
    a.unit.network.settle_refuses = lambda peer_id: peer_id == "suspect"
    for name, phase in (others or {}).items():
        a.records.publish_progress(progress(name, 0, a.unit.loaded.fingerprint).copy(update={"phase": phase}))
    train_until_round(a)
    unread = {"b": 0.0, "c": 0.0}  # live while training, but no read at exit shows them
    a.unit.engine.census = unread if others is None else dict.fromkeys(others, 0.0)
    patience = settle_patience(a.unit.engine, a.unit.throughput.step_time_s)
    settle_rounds = 4 + patience if waits else (0 if leaves_together else 1)
    a.unit.finish()
    assert patience >= 8  # quick units' final rounds: a window of at least 2 s, 1 s of slack, a 30 s all-reduce
    assert len(settle.members) == (1 if settle_rounds else 0)
    assert all(len(averager.begun) == settle_rounds and averager.is_shut_down for averager in settle.members)
    assert a.averager.is_shut_down  # the round averager made room for the settle averager
    assert [end.kind for end in a.events(ConsensusRound)] == ["settle"] * settle_rounds
    phases = [record.phase for record in a.records.published if record.peer_id == "a"]
    assert phases[-settle_rounds - 2 :] == ["finishing"] * (settle_rounds + 1) + ["left"]


def test_units_leaving_together_settle_when_another_publishes_a_different_phi(
    make_peer: PeerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """The final round held both units leaving, but the other one's record shows another φ after it (its all-reduce
    ended with parts missing, say): the settle rounds follow rather than a unit leaving one outer step apart."""
    caplog.set_level(logging.INFO, logger="p2p_diloco.rounds.departure")
    group, settle = FakeGroup(), FakeGroup()
    a = make_peer("a", group, settle_group=settle, outer__settle_rounds=1, outer__min_window_s=0.25)
    b = make_peer("b", group)
    inner_step(a)
    other = progress("b", 0, a.unit.loaded.fingerprint).copy(update={"phase": "finishing", "probe": [9.0] * 32})
    a.records.publish_progress(other)
    a.unit.engine.census = {"b": 0.0}
    assert b.unit.engine.begin_final(0.1, None, GroupRequest(TOGETHER_BITS, 2))  # b waits in the final round's group
    a.unit.finish()
    assert a.averager.begun[-1].group.subgroup == TOGETHER_BITS and group.rounds and len(group.rounds[-1]) == 2
    assert "do not all hold this unit's φ" in caplog.text and settle.members and settle.members[0].begun


@pytest.mark.parametrize(("later", "settle_rounds"), [(None, None), ("left", 1)], ids=["expired", "left"])
def test_a_unit_read_finishing_counts_until_a_read_shows_it_in_another_phase(
    make_peer: PeerFactory, later: Phase | None, settle_rounds: int | None
) -> None:
    """A unit read finishing once still counts when its record is gone from later reads (it may have expired in a
    long final round): the lone settle rounds go on as far as they may; a read that shows it left ends them."""
    settle = FakeGroup()
    a = make_peer("a", FakeGroup(), settle_group=settle, outer__settle_rounds=4)
    train_until_round(a)
    fingerprint = a.unit.loaded.fingerprint
    own, other = (progress(name, 0, fingerprint).copy(update={"phase": "finishing"}) for name in ("a", "b"))
    after = {"a": own} if later is None else {"a": own, "b": other.copy(update={"phase": later})}
    reads = iter([{"a": own, "b": other}])
    a.records.read_progress = lambda: next(reads, after)  # type: ignore[method-assign]
    a.unit.finish()
    patience = settle_patience(a.unit.engine, a.unit.throughput.step_time_s)
    assert len(settle.members[0].begun) == (4 + patience if settle_rounds is None else settle_rounds)


def test_a_settle_averager_that_fails_to_start_costs_only_the_settle_rounds(
    make_peer: PeerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Its averager process failing at exit (seen once: torch's shared memory manager timed out after the unit was
    frozen), the unit still evaluates, checkpoints and announces that it left."""

    def fails(_template: Sequence[torch.Tensor]) -> FakeAverager:
        raise RuntimeError("Shared memory manager connection has timed out")

    a = make_peer("a", FakeGroup(), settle_group=FakeGroup())
    a.unit.network.settle_averager = fails
    a.records.publish_progress(progress("b", 0, a.unit.loaded.fingerprint).copy(update={"phase": "finishing"}))
    train_until_round(a)  # b never joins the final round: settle rounds would follow
    a.unit.finish()
    assert "the settle averager did not start" in caplog.text
    assert a.events(Stop) and not a.events(ConsensusRound)
    checkpoint = load_checkpoint(a.unit.checkpoint_path)
    assert checkpoint is not None and checkpoint["outer_round"] == a.unit.outer_round
    assert [record.phase for record in a.records.published if record.peer_id == "a"][-1] == "left"


def test_a_census_read_without_its_own_record_falls_back_to_the_live_units(make_peer: PeerFactory) -> None:
    """A DHT read that lacks the unit's own "finishing" record is incomplete: the settle rounds go on while the last
    census of live units (3) is more than the rounds held."""
    settle = FakeGroup()
    incomplete = FakeRecords()
    incomplete.read_progress = dict  # type: ignore[method-assign]  # every read comes back empty
    a = make_peer("a", FakeGroup(), records=incomplete, settle_group=settle, outer__settle_rounds=3)
    a.unit.engine.census = {"a": 0.0, "b": 0.0, "c": 0.0}
    train_until_round(a)
    a.unit.finish()
    assert len(settle.members[0].begun) == 3 + settle_patience(a.unit.engine, a.unit.throughput.step_time_s)


def test_finish_drops_a_round_that_does_not_end_in_time(make_peer: PeerFactory) -> None:
    group = FakeGroup()
    a, _absent = make_peer("a", group), make_peer("b", group)
    seconds = train_until_round(a)
    a.unit.finish()
    assert a.averager.cancelled == 1 and not a.averager.in_flight and sent_round(a.unit.engine, 0) is None
    assert a.unit.state.fragments[0].tokens_since_round == 2 * TOKENS_PER_STEP
    assert a.unit.state.fragments[0].compute_since_round == pytest.approx(seconds)
    stop = a.events(Stop)[-1]
    assert stop.useful_compute_s == 0.0 and stop.goodput == 0.0
    assert stop.compute_s == pytest.approx(seconds) and saved_ledger(a).compute_s == stop.compute_s
    checkpoint = load_checkpoint(a.unit.checkpoint_path)
    assert checkpoint is not None and checkpoint["outer_round"] == 0


# ----------------------------------------------------------------------------------------------- goodput
def test_a_merged_round_makes_the_compute_of_its_steps_useful(make_peer: PeerFactory) -> None:
    a = make_peer("a", FakeGroup())
    seconds = train_until_round(a)
    assert a.unit.ledger.useful_compute_s == 0.0 and a.unit.state.fragments[0].compute_since_round == 0.0
    overlap = inner_step(a)  # trained while the round was in flight: it belongs to the next round
    assert poll(a)
    ledger = a.unit.ledger
    assert ledger.useful_compute_s == pytest.approx(seconds) and ledger.useful_tokens == 2 * TOKENS_PER_STEP
    assert ledger.compute_s == pytest.approx(seconds + overlap) and ledger.tokens == 3 * TOKENS_PER_STEP
    assert a.unit.state.fragments[0].compute_since_round == pytest.approx(overlap)
    assert saved_ledger(a) == ledger  # saved once per merged round
    event = a.events(OuterRound)[-1]
    assert event.useful_compute_s == ledger.useful_compute_s and event.useful_tokens == 2 * TOKENS_PER_STEP
    a.unit.publish("training", wait=False)
    published = a.records.progress["a"]
    assert published.useful_compute_s == ledger.useful_compute_s and published.allocated_s > 0


def test_a_failed_round_carries_its_compute_into_the_next_merge(make_peer: PeerFactory) -> None:
    group = FakeGroup(FaultPlan().fail("a", call=0))
    a = make_peer("a", group)
    first = train_until_round(a)
    assert poll(a)
    assert a.unit.ledger.useful_compute_s == 0.0 and a.unit.state.fragments[0].compute_since_round == pytest.approx(
        first
    )
    second = train_until_round(a)
    assert poll(a)
    assert a.unit.ledger.useful_compute_s == pytest.approx(first + second)
    assert a.unit.ledger.useful_tokens == 4 * TOKENS_PER_STEP
    assert a.events(OuterRound)[-1].useful_compute_s == pytest.approx(first + second)


def test_a_local_reset_discards_the_compute_of_its_steps(make_peer: PeerFactory) -> None:
    a = make_peer("a", FakeGroup(), outer__inner_steps=1)
    discarded = inner_step(a)
    poisoned = a.unit.trainer.local_parameters()
    poisoned[0].view(-1)[0] = float("nan")
    a.unit.trainer.load_parameters(poisoned)
    assert maybe_begin(a) and a.events(LocalReset) and sent_round(a.unit.engine, 0) is None
    assert a.unit.state.fragments[0].compute_since_round == 0.0
    kept = train_until_round(a)
    assert poll(a)
    assert a.unit.ledger.useful_compute_s == pytest.approx(kept)
    assert a.unit.ledger.compute_s == pytest.approx(discarded + kept)


def test_the_ledger_survives_a_restart_on_the_same_work_dir(make_peer: PeerFactory) -> None:
    first = make_peer("a", FakeGroup())
    train_until_round(first)
    assert poll(first)
    merged = first.unit.ledger
    again = make_peer("a", FakeGroup())  # as after a SIGKILL: nothing saved on exit
    assert again.unit.ledger.starts == 2 and merged.starts == 1
    assert again.unit.ledger.allocated_since == merged.allocated_since
    assert again.unit.ledger.useful_compute_s == merged.useful_compute_s > 0


def test_outer_round_begin_announces_when_the_all_reduce_starts(make_peer: PeerFactory) -> None:
    a = make_peer("a", FakeGroup())
    before = time.time()
    train_until_round(a)
    (begin,) = a.events(OuterRoundBegin)
    begun = a.averager.begun[-1]
    assert begin.window_s == begun.window_s > 0
    assert begin.scheduled_at == pytest.approx(begin.time + begin.window_s, abs=0.1)
    assert begin.scheduled_at >= before + begin.window_s
    assert (begin.outer_round, begin.inner_step, begin.weight) == (0, 2, 2 * TOKENS_PER_STEP)
