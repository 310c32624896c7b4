"""Streaming fragments and compressed pseudo-gradients in a LearningUnit, against in-memory fakes (no network):
the merge rule per fragment, the compressed payload with error feedback, consensus rounds and the in-flight bound."""

from __future__ import annotations

import pytest
import torch
from fakes import FakeGroup, FaultPlan, clone_all
from unit_peers import TOKENS_PER_STEP, Peer, PeerFactory, inner_step, maybe_begin, poll, sent_round

from p2p_diloco.diloco import OuterHyperparams, merge_local_progress, outer_step, pseudo_gradient, weighted_average
from p2p_diloco.fragments import copies, partition
from p2p_diloco.network.compression import roundtrip
from p2p_diloco.streaming import FragmentRounds, Payload
from p2p_diloco.unit.events import ConsensusRound, OuterRound

STREAMING = dict(outer__fragments=2, outer__inner_steps=2, outer__max_in_flight=2)


def fragment_state(peer: Peer, number: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """(φ_p, m_p, θ_p) of a unit, copied."""
    fragment = peer.unit.state.fragments[number].fragment
    unit = peer.unit
    return (
        copies(unit.state.global_params, fragment),
        copies(unit.state.momentum, fragment),
        copies(unit.trainer.params, fragment),
    )


def step_both(*peers: Peer) -> None:
    for peer in peers:
        inner_step(peer)
        maybe_begin(peer)


def test_a_fragment_round_merges_that_fragment_only(make_peer: PeerFactory) -> None:
    groups = [FakeGroup(), FakeGroup()]
    a, b = make_peer("a", groups, **STREAMING), make_peer("b", groups, **STREAMING)
    before = {peer.work_dir.name: [fragment_state(peer, number) for number in (0, 1)] for peer in (a, b)}
    step_both(a, b)  # fragment 0 is due after H·1/2 = 1 step, fragment 1 after 2
    assert [len(group.rounds) for group in groups] == [1, 0]
    sent = {peer.work_dir.name: fragment_state(peer, 0)[2] for peer in (a, b)}
    inner_step(a)  # one overlapped step before the average is merged
    assert poll(a)
    hyper = a.unit.engine.plan.step.hyper
    proposals = [
        outer_step(*before[name][0][:2], pseudo_gradient(before[name][0][0], sent[name]), hyper) for name in "ab"
    ]
    expected_phi = weighted_average([phi for phi, _ in proposals], [TOKENS_PER_STEP] * 2)
    phi, momentum, theta = fragment_state(a, 0)
    torch.testing.assert_close(phi, expected_phi, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(momentum, weighted_average([m for _, m in proposals], [1, 1]), rtol=1e-5, atol=1e-6)
    assert (
        a.unit.state.fragments[0].outer_round == 1
        and a.unit.state.fragments[1].outer_round == 0
        and a.unit.outer_round == 0
    )
    phi_1, momentum_1, _ = fragment_state(a, 1)  # the other fragment: global state untouched
    assert all(torch.equal(x, y) for x, y in zip(phi_1 + momentum_1, before["a"][1][0] + before["a"][1][1]))
    assert a.events(OuterRound)[-1].fragment == 0 and a.events(OuterRound)[-1].overlap_steps == 1
    assert len(theta) == len(phi)


def test_merge_keeps_the_overlapped_steps_of_the_fragment(make_peer: PeerFactory) -> None:
    groups = [FakeGroup(), FakeGroup()]
    a, b = make_peer("a", groups, **STREAMING), make_peer("b", groups, **STREAMING)
    step_both(a, b)
    sent = fragment_state(a, 0)[2]
    inner_step(a)
    local_now = fragment_state(a, 0)[2]
    assert poll(a)
    phi, _, theta = fragment_state(a, 0)
    torch.testing.assert_close(theta, merge_local_progress(phi, local_now, sent), rtol=0, atol=1e-6)


@pytest.mark.parametrize("codec", ["fp16", "int8"])
def test_compressed_rounds_average_pseudo_gradients_with_error_feedback(make_peer: PeerFactory, codec: str) -> None:
    settings = dict(outer__codec=codec, outer__inner_steps=2, outer__consensus_every_rounds=0)
    group = FakeGroup()
    a, b = make_peer("a", group, **settings), make_peer("b", group, **settings)
    phi0, m0, _ = fragment_state(a, 0)
    for _ in range(2):
        step_both(a, b)
    deltas = [begun.proposal for begun in group.rounds[-1].values()]
    assert all(len(delta) == len(phi0) for delta in deltas)  # the payload is Δ alone: no φ, no momentum
    assert poll(a) and poll(b)
    expected_phi, expected_m = outer_step(phi0, m0, weighted_average(deltas, [1, 1]), a.unit.engine.plan.step.hyper)
    phi, momentum, _ = fragment_state(a, 0)
    torch.testing.assert_close(phi, expected_phi, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(momentum, expected_m, rtol=1e-5, atol=1e-6)
    # error feedback: what the codec dropped from the first Δ rides on the second one
    residual = a.unit.state.fragments[0].error_feedback.state_dict()["residuals"]
    first_payload = group.rounds[-1][a.averager].proposal
    torch.testing.assert_close(residual, [t - roundtrip(t, codec) for t in first_payload], rtol=0, atol=0)
    assert any(bool(r.abs().max() > 0) for r in residual)
    phi_before, _, _ = fragment_state(a, 0)
    for _ in range(2):
        step_both(a, b)
    theta_sent = group.rounds[-1][a.averager].proposal
    delta_2 = pseudo_gradient(phi_before, sent_round(a.unit.engine, 0).local_at_send)
    torch.testing.assert_close(theta_sent, [d + r for d, r in zip(delta_2, residual)], rtol=1e-6, atol=1e-7)


def test_a_refused_compressed_round_leaves_the_error_feedback_residual_as_it_was(make_peer: PeerFactory) -> None:
    settings = dict(outer__codec="int8", outer__inner_steps=2, outer__consensus_every_rounds=0)
    group = FakeGroup(FaultPlan().refuse("a", call=1))  # its averager's tensors are held at its second round
    a, b = make_peer("a", group, **settings), make_peer("b", group, **settings)
    for _ in range(2):
        step_both(a, b)
    assert poll(a) and poll(b)
    residual = [r.clone() for r in a.unit.state.fragments[0].error_feedback.state_dict()["residuals"]]
    for _ in range(2):
        inner_step(a)
    assert (
        not maybe_begin(a) and sent_round(a.unit.engine, 0) is None and a.unit.state.fragments[0].steps_since_round == 2
    )
    assert all(
        torch.equal(x, y) for x, y in zip(a.unit.state.fragments[0].error_feedback.state_dict()["residuals"], residual)
    )
    assert maybe_begin(a)
    delta = pseudo_gradient(fragment_state(a, 0)[0], sent_round(a.unit.engine, 0).local_at_send)
    torch.testing.assert_close(
        a.averager.begun[-1].proposal, [d + r for d, r in zip(delta, residual)], rtol=1e-6, atol=1e-7
    )


def test_consensus_round_pulls_drifted_fragments_to_the_group_mean(make_peer: PeerFactory) -> None:
    settings = dict(outer__codec="fp16", outer__consensus_every_rounds=1, **STREAMING)
    groups, consensus = [FakeGroup(), FakeGroup()], [FakeGroup(), FakeGroup()]
    a = make_peer("a", groups, consensus_groups=consensus, **settings)
    b = make_peer("b", groups, consensus_groups=consensus, **settings)
    b.unit.state.global_params = [tensor + 0.01 for tensor in b.unit.state.global_params]  # b's φ drifted from a's
    step_both(a, b)  # fragment 0's round
    assert poll(a) and poll(b)
    assert a.unit.engine.consensus.waiting == [0] and b.unit.engine.consensus.waiting == [0]
    phi_a = fragment_state(a, 0)[0]
    phi_b = fragment_state(b, 0)[0]
    assert max(float((x - y).abs().max()) for x, y in zip(phi_a, phi_b)) > 1e-3
    step_both(a, b)  # fragment 1's round and fragment 0's consensus round
    assert [len(group.rounds) for group in consensus] == [1, 0]
    theta_a = fragment_state(a, 0)[2]
    a.unit.poll_round(), b.unit.poll_round()
    phi_a_after, _, theta_a_after = fragment_state(a, 0)
    phi_b_after = fragment_state(b, 0)[0]
    torch.testing.assert_close(phi_a_after, phi_b_after, rtol=0, atol=1e-6)
    torch.testing.assert_close(phi_a_after, [(x + y) / 2 for x, y in zip(phi_a, phi_b)], rtol=0, atol=1e-6)
    shift = [after - before for after, before in zip(phi_a_after, phi_a)]  # θ moved with φ
    torch.testing.assert_close(theta_a_after, [t + s for t, s in zip(clone_all(theta_a), shift)], rtol=0, atol=1e-5)
    assert a.events(ConsensusRound)[-1].applied is True


def test_unit_never_has_more_rounds_in_flight_than_configured(make_peer: PeerFactory) -> None:
    groups = [FakeGroup() for _ in range(4)]
    a = make_peer("a", groups, outer__fragments=4, outer__inner_steps=4, outer__max_in_flight=1)
    make_peer("absent", groups, outer__fragments=4, outer__inner_steps=4)  # never begins: rounds stay in flight
    for _ in range(30):
        inner_step(a)
        a.unit.poll_round()
        maybe_begin(a)
        assert len(a.unit.engine.in_flight) <= 1
    assert sum(len(averager.begun) for averager in a.averagers) == 1
    assert a.unit.state.fragments[1].steps_since_round >= 4  # due, but waiting for a free slot


@pytest.mark.parametrize("kind", list(Payload))
def test_a_payload_minus_its_reference_is_the_step_on_its_pseudo_gradient_alone(kind: Payload) -> None:
    """The reference a round judges members' directions from (the payload of a unit that trained nothing): a
    proposal minus it is −lr·(1 + μ)·Δ with Nesterov (its momentum part, when synced, +Δ); a pseudo-gradient's is 0."""
    generator = torch.Generator().manual_seed(0)
    phi = [torch.randn(3, 4, generator=generator), torch.randn(5, generator=generator)]
    momentum = [torch.randn_like(tensor) for tensor in phi]
    local = [tensor - 0.1 * torch.randn(tensor.shape, generator=generator) for tensor in phi]
    hyper = OuterHyperparams(lr=0.7, momentum=0.9, nesterov=True)
    rounds = FragmentRounds(partition([tensor.shape for tensor in phi], 1)[0], 1.0, kind)
    payload, _, _ = rounds.payload(phi, momentum, local, hyper)
    reference = rounds.reference(phi, momentum, hyper)
    delta = pseudo_gradient(phi, local)
    steps = [sent - still for sent, still in zip(payload, reference)]
    expected = delta if kind is Payload.PSEUDO_GRADIENT else [-0.7 * 1.9 * piece for piece in delta]
    if kind is Payload.PROPOSAL_WITH_MOMENTUM:
        expected = expected + delta
    assert len(steps) == len(expected)
    for step, piece in zip(steps, expected):
        torch.testing.assert_close(step, piece)
