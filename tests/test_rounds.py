"""The outer round's home (p2p_diloco/rounds): the plan derived from [outer], the key schema (which settings make
units meet and share state, also on a real hivemind DHT), and the engine's typed results against in-memory fakes."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hivemind
import pytest
import torch
from fakes import FakeGroup, FaultPlan
from swarms import record_peers

import p2p_diloco.rounds
from p2p_diloco.config import ConfigError, OuterSection
from p2p_diloco.diloco import OuterHyperparams
from p2p_diloco.network.averaging import OuterAverager
from p2p_diloco.network.records import SwarmRecords
from p2p_diloco.network.state_sync import StateServer, SwarmState
from p2p_diloco.rounds.engine import RoundEngine
from p2p_diloco.rounds.plan import ConsensusRounds, Groups, RoundPlan, Window
from p2p_diloco.rounds.results import RoundKind, RoundStatus
from p2p_diloco.streaming import Payload

SHAPES = [(64, 8), (8,), (16, 4)]
TOKENS = 10

# Settings that change neither what a round carries nor the outer step: units that differ in them meet and share state.
NEUTRAL = [
    {"quorum": 2},
    {"target_group_size": 4},
    {"window_fraction": 0.25, "min_window_s": 0.5, "max_window_s": 10.0},
    {"allreduce_timeout_s": 5.0},
    {"inner_steps": 7},
    {"warmup_rounds": 2},
    {"max_in_flight": 1},
    {"consensus_tolerance": 0.5},
    {"schedule": "clock"},
    {"settle_rounds": 0},
]
# Settings that shape a round: units that differ in any of them never meet (but still share state).
ROUND_SETTINGS = [
    {"codec": "fp16"},
    {"codec": "int8"},
    {"sync_momentum": False},
    {"outer_lr": 0.5},
    {"outer_momentum": 0.8},
    {"nesterov": False},
    {"merge": "rda"},
]


def plan_of(**outer: Any) -> RoundPlan:
    """A plan of ``outer`` settings on the steps schedule and with an outer momentum unless told (the engine tests
    count steps; the clock schedule has its own tests)."""
    return RoundPlan.from_config(OuterSection(**{"schedule": "steps", "outer_momentum": 0.9, **outer}), SHAPES)


# ------------------------------------------------------------------------------------------------------ plan
def test_the_codec_decides_what_a_round_carries_and_whether_consensus_rounds_run() -> None:
    assert plan_of().step.payload is Payload.PROPOSAL_WITH_MOMENTUM and plan_of().consensus is None
    assert plan_of(sync_momentum=False).step.payload is Payload.PROPOSAL
    assert plan_of(outer_momentum=0.0).step.payload is Payload.PROPOSAL, "at momentum 0 m is never used: never sent"
    lossy = plan_of(codec="int8", consensus_every_rounds=3, consensus_tolerance=0.5)
    assert lossy.step.payload is Payload.PSEUDO_GRADIENT and lossy.step.error_feedback
    assert lossy.consensus == ConsensusRounds(every_rounds=3, tolerance=0.5)
    assert plan_of(codec="fp16", consensus_every_rounds=0).consensus is None
    assert plan_of(codec="fp32", consensus_every_rounds=3).consensus is None, "proposals pull φ together themselves"
    assert not plan_of(codec="fp16", error_feedback=False).step.error_feedback


def test_the_plan_groups_the_outer_settings() -> None:
    plan = plan_of(quorum=2, target_group_size=4, allreduce_timeout_s=5.0, window_fraction=0.25, min_window_s=0.5,
                   max_window_s=10.0, outer_lr=0.5, nesterov=False, settle_rounds=3, max_in_flight=1)  # fmt: skip
    assert plan.group == Groups(quorum=2, target_size=4, allreduce_timeout_s=5.0)
    assert plan.window == Window(fraction=0.25, min_s=0.5, max_s=10.0)
    assert plan.step.hyper == OuterHyperparams(lr=0.5, momentum=0.9, nesterov=False) and plan.step.codec == "fp32"
    assert (plan.settle_rounds, plan.max_in_flight, plan.inner_steps, plan.schedule) == (3, 1, 20, "steps")


def test_templates_follow_the_fragments_and_the_payload() -> None:
    trained = [torch.zeros(shape) for shape in SHAPES]
    plan = plan_of(fragments=2)
    templates = plan.round_templates(trained)
    assert len(templates) == 2
    for fragment, template in zip(plan.fragments, templates):
        assert sum(tensor.numel() for tensor in template) == 2 * fragment.numel  # φ'_p and m'_p
    assert [[t.numel() for t in template] for template in plan.consensus_templates()] == [
        [fragment.numel] for fragment in plan.fragments
    ]
    lossy = plan_of(fragments=2, codec="fp16")
    assert [sum(t.numel() for t in template) for template in lossy.round_templates(trained)] == [
        fragment.numel for fragment in lossy.fragments
    ]


def test_the_matchmaking_window_is_a_clamped_fraction_of_the_period() -> None:
    plan = plan_of(inner_steps=20, window_fraction=0.5, min_window_s=1.0, max_window_s=8.0)
    assert plan.window_s(None) == 1.0  # nothing measured yet
    assert plan.window_s(0.5) == pytest.approx(5.0)
    assert plan.window_s(0.01) == 1.0 and plan.window_s(10.0) == 8.0
    engine = engine_of(plan, [FakeGroup()])
    assert engine.final_round_bound_s(0.5) == pytest.approx(5.0 + 1.0 + plan.group.allreduce_timeout_s)


def test_warm_up_rounds_halve_h_back_from_the_last_one_and_their_windows_follow() -> None:
    plan = plan_of(inner_steps=100, warmup_rounds=2, window_fraction=0.5, min_window_s=1.0, max_window_s=80.0)
    assert [plan.inner_steps_at(outer_round) for outer_round in range(5)] == [25, 50, 100, 100, 100]
    assert plan_of(inner_steps=3, warmup_rounds=3).inner_steps_at(0) == 1  # never below one step
    assert plan_of(inner_steps=100).inner_steps_at(0) == 100
    assert plan.window_s(0.5, plan.inner_steps_at(0)) == pytest.approx(6.25) and plan.window_s(0.5) == 25.0


def test_a_fragment_count_the_model_cannot_be_split_into_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="--fragments"):
        RoundPlan.from_config(OuterSection(fragments=3), [(2, 3)])  # two rows for three fragments


# ------------------------------------------------------------------------------------------------ key schema
@pytest.mark.parametrize("settings", NEUTRAL + ROUND_SETTINGS + [{"consensus_every_rounds": 3, "codec": "fp16"}])
def test_units_differing_in_anything_but_run_model_and_fragments_share_state(settings: dict[str, Any]) -> None:
    assert plan_of(**settings).keys("run", "f00d").state() == plan_of().keys("run", "f00d").state()


def test_lossy_units_that_differ_only_in_consensus_rounds_share_state() -> None:
    """The state server's key once took the last consensus averager's prefix: such units could not download from
    each other."""
    with_consensus = plan_of(codec="fp16", consensus_every_rounds=10).keys("run", "f00d")
    without = plan_of(codec="fp16", consensus_every_rounds=0).keys("run", "f00d")
    assert with_consensus.state() == without.state() == "run_f00d_p1_state"
    assert with_consensus.fragment_round(0) == without.fragment_round(0)


@pytest.mark.parametrize("settings", NEUTRAL)
def test_units_differing_only_in_neutral_settings_meet(settings: dict[str, Any]) -> None:
    reference, other = plan_of().keys("run", "f00d"), plan_of(**settings).keys("run", "f00d")
    assert other.fragment_round(0) == reference.fragment_round(0)


@pytest.mark.parametrize("settings", ROUND_SETTINGS)
def test_units_whose_round_settings_differ_never_meet(settings: dict[str, Any]) -> None:
    assert plan_of(**settings).keys("run", "f00d").fragment_round(0) != plan_of().keys("run", "f00d").fragment_round(0)


def test_the_run_the_model_and_the_fragments_separate_everything() -> None:
    keys = plan_of().keys("run", "f00d")
    others = [plan_of().keys("other", "f00d"), plan_of().keys("run", "beef"), plan_of(fragments=2).keys("run", "f00d")]
    for other in others:
        assert other.state() != keys.state() and other.fragment_round(0) != keys.fragment_round(0)
        assert other.consensus_round(0) != keys.consensus_round(0)


def test_consensus_rounds_meet_across_lossy_codecs_and_every_prefix_is_a_valid_hivemind_prefix() -> None:
    fp16, int8 = plan_of(codec="fp16").keys("run", "f00d"), plan_of(codec="int8", outer_lr=0.3).keys("run", "f00d")
    assert fp16.consensus_round(1) == int8.consensus_round(1) != fp16.consensus_round(0)
    prefixes = [fp16.state(), fp16.fragment_round(0), fp16.consensus_round(0), int8.fragment_round(0)]
    assert len(set(prefixes)) == len(prefixes) and not any("." in prefix for prefix in prefixes)


# --------------------------------------------------------------------------------------------------- engine
def engine_of(plan: RoundPlan, groups: list[FakeGroup], unit: str = "a") -> RoundEngine:
    torch.manual_seed(0)
    local = [torch.randn(shape) for shape in SHAPES]
    averagers = [group.averager(template, unit) for group, template in zip(groups, plan.round_templates(local))]
    return RoundEngine(plan, averagers, local=local)


def train(engine: RoundEngine, steps: int) -> None:
    """``steps`` inner steps that each move θ a little."""
    for _ in range(steps):
        with torch.no_grad():
            for tensor in engine.state.local:
                tensor.add_(0.01)
        engine.record_step(TOKENS, 0.1)


def test_the_engine_reports_every_outcome_and_changes_phi_only_on_a_merge() -> None:
    group = FakeGroup(FaultPlan().fail("a", call=1).refuse("a", call=2))
    engine = engine_of(plan_of(inner_steps=2, quorum=1), [group])
    train(engine, 2)
    (begun,) = engine.begin_due(step_time_s=0.1)
    assert (begun.kind, begun.status, begun.weight, begun.window_s) == (RoundKind.FRAGMENT, RoundStatus.BEGUN, 20, 2.0)
    (alone,) = engine.poll()
    assert alone.status is RoundStatus.ALONE and alone.merged and alone.advanced and alone.outer_round == 1
    assert alone.useful_tokens == 2 * TOKENS and alone.useful_compute_s == pytest.approx(0.2)
    phi = [tensor.clone() for tensor in engine.state.global_params]
    train(engine, 2)
    assert engine.begin_due(0.1)[0].status is RoundStatus.BEGUN
    (failed,) = engine.poll()  # call 1 fails for the whole group
    assert failed.status is RoundStatus.FAILED and not failed.merged and not failed.advanced
    assert all(torch.equal(a, b) for a, b in zip(engine.state.global_params, phi)) and engine.outer_round == 1
    train(engine, 2)
    (deferred,) = engine.begin_due(0.1)  # call 2 is refused: still due
    assert deferred.status is RoundStatus.DEFERRED and engine.state.fragments[0].steps_since_round == 2
    assert engine.begin_due(0.1)[0].status is RoundStatus.BEGUN
    (merged,) = engine.poll()
    assert merged.status is RoundStatus.ALONE and merged.weight == 4 * TOKENS  # the failed round's tokens carried
    assert engine.outer_round == 2


def test_a_non_finite_average_is_rejected_and_a_non_finite_theta_resets_to_phi() -> None:
    group = FakeGroup()
    engine = engine_of(plan_of(inner_steps=1), [group])
    rogue = group.averager(plan_of().round_templates(engine.state.local)[0], "rogue")
    train(engine, 1)
    engine.begin_due(0.1)
    poisoned = [torch.full_like(tensor, float("nan")) for tensor in plan_of().round_templates(engine.state.local)[0]]
    rogue.begin_round(poisoned, weight=1.0, outer_round=0, window_s=1.0)
    (rejected,) = engine.poll()
    assert rejected.status is RoundStatus.REJECTED and rejected.error == "the average was not finite"
    assert engine.outer_round == 0
    rogue.poll()
    with torch.no_grad():
        engine.state.local[0].view(-1)[0] = float("inf")
    train(engine, 1)
    (reset,) = engine.begin_due(0.1)
    assert reset.status is RoundStatus.RESET and not engine.in_flight
    assert all(torch.equal(theta, phi) for theta, phi in zip(engine.state.local, engine.state.global_params))


def test_an_average_that_moves_phi_far_beyond_the_units_own_step_is_rejected_and_carried() -> None:
    """A member's payload ×1000 is rejected (φ, m, θ unchanged, the tokens carried); the same group's honest average,
    which moves φ about as far as the unit's own step, merges."""
    group = FakeGroup()
    engine = engine_of(plan_of(inner_steps=2), [group])
    template = plan_of().round_templates(engine.state.local)[0]
    other = group.averager(template, "other")
    train(engine, 2)
    phi, theta = [t.clone() for t in engine.state.global_params], [t.clone() for t in engine.state.local]
    engine.begin_due(0.1)
    sent = [tensor.clone() for tensor in group._waiting[group.members[0]].proposal]
    other.begin_round([tensor * 1000 for tensor in sent], weight=float(2 * TOKENS), outer_round=0, window_s=1.0)
    (rejected,) = engine.poll()
    assert rejected.status is RoundStatus.REJECTED and not rejected.merged and engine.outer_round == 0
    assert rejected.error is not None and "own step" in rejected.error
    assert all(torch.equal(a, b) for a, b in zip(engine.state.global_params, phi))
    assert all(torch.equal(a, b) for a, b in zip(engine.state.local, theta))
    other.poll()
    train(engine, 2)
    engine.begin_due(0.1)
    honest = [tensor.clone() for tensor in group._waiting[group.members[0]].proposal]
    other.begin_round(honest, weight=float(4 * TOKENS), outer_round=0, window_s=1.0)
    (merged,) = engine.poll()
    assert merged.status is RoundStatus.MERGED and merged.weight == 4 * TOKENS  # the rejected round's tokens carried


def test_with_two_fragments_the_unit_round_advances_when_both_have_merged() -> None:
    groups = [FakeGroup(), FakeGroup()]
    engine = engine_of(plan_of(inner_steps=2, fragments=2, max_in_flight=2), groups)
    advanced = []
    for _ in range(4):
        train(engine, 1)
        engine.begin_due(0.1)
        advanced += [(end.fragment, end.advanced) for end in engine.poll()]
    assert advanced[:2] == [(0, False), (1, True)] and engine.outer_round >= 1


def test_the_engine_refuses_averagers_that_do_not_match_its_plan() -> None:
    plan = plan_of(codec="fp16", consensus_every_rounds=2)
    local = [torch.zeros(shape) for shape in SHAPES]
    averagers = [FakeGroup().averager(template) for template in plan.round_templates(local)]
    with pytest.raises(ValueError, match="consensus"):
        RoundEngine(plan, averagers, local=local)  # consensus rounds need their own averagers


def _merged_phi(sync_momentum: bool, merge: str, scales: tuple[float, ...]) -> list[torch.Tensor]:
    """φ after one round of units whose Δ are ``scales`` × one direction (weights 1, 2, ...: their steps)."""
    plan = plan_of(inner_steps=1, sync_momentum=sync_momentum, merge=merge, quorum=1)
    group = FakeGroup()
    engines = [engine_of(plan, [group], unit=f"u{index}") for index in range(len(scales))]
    torch.manual_seed(1)
    direction = [torch.randn(shape) for shape in SHAPES]
    for index, (engine, scale) in enumerate(zip(engines, scales)):
        with torch.no_grad():
            for theta, step in zip(engine.state.local, direction):
                theta.sub_(scale * step)
        for _ in range(index + 1):
            engine.record_step(TOKENS, 0.1)
        engine.state.fragments[0].steps_since_round = 1
    for engine in engines:
        assert engine.begin_due(0.1)[0].status is RoundStatus.BEGUN
    ends = [engine.poll() for engine in engines]
    assert all(end.status is RoundStatus.MERGED for (end,) in ends)
    first = engines[0].state.global_params
    assert all(torch.equal(a, b) for other in engines[1:] for a, b in zip(first, other.state.global_params))
    return first


@pytest.mark.parametrize("sync_momentum", [True, False])
def test_an_rda_round_of_parallel_pseudo_gradients_equals_the_mean_round(sync_momentum: bool) -> None:
    for rda, mean in zip(_merged_phi(sync_momentum, "rda", (1.0, 3.0)), _merged_phi(sync_momentum, "mean", (1.0, 3.0))):
        torch.testing.assert_close(rda, mean)


def test_rda_carries_directions_and_norms_and_needs_fp32() -> None:
    trained = [torch.zeros(shape) for shape in SHAPES]
    plan = RoundPlan.from_config(OuterSection(merge="rda", fragments=2, outer_momentum=0.9), SHAPES, embeddings={0})
    for fragment, template in zip(plan.fragments, plan.round_templates(trained)):
        pieces = len(fragment.pieces)
        assert len(template) == 3 * pieces + 1 and template[-1].shape == (pieces,)  # φ'_p, m'_p, directions, norms
        assert plan.radial(fragment) == tuple(piece.index != 0 for piece in fragment.pieces)
    assert plan_of().radial(plan.fragments[0]) is None
    with pytest.raises(ValueError, match="fp32"):
        OuterSection(merge="rda", codec="int8")


# ------------------------------------------------------------------------------- the schema on a real DHT
@pytest.fixture
def two_dhts() -> Iterator[tuple[SwarmRecords, SwarmRecords]]:
    """Two DHT servers of an open run with the run's records (donors declare themselves there)."""
    with record_peers(2) as (first, second):
        yield first, second


@pytest.mark.swarm
def test_on_a_real_dht_units_share_state_across_round_settings_but_not_across_fragment_counts(
    two_dhts: tuple[SwarmRecords, SwarmRecords],
) -> None:
    """A donor with fp32 proposals serves its state; a joiner with int8 pseudo-gradients, consensus rounds and another
    outer step downloads it; a joiner that splits the model into another number of fragments finds no donor."""
    donor, joiner = two_dhts
    template = [torch.zeros(shape) for shape in SHAPES]
    donor_plan, joiner_plan = plan_of(), plan_of(codec="int8", consensus_every_rounds=2, outer_lr=0.3, quorum=2)
    servers = [
        StateServer(donor.dht, donor_plan.keys("run", "f00d").state(), template, donor),
        StateServer(joiner.dht, joiner_plan.keys("run", "f00d").state(), template, joiner),
        StateServer(joiner.dht, plan_of(fragments=2).keys("run", "f00d").state(), template, joiner, fragments=2),
    ]
    try:
        state = SwarmState([torch.full(shape, 0.5) for shape in SHAPES], [torch.ones(s) for s in SHAPES], [4], 80, 640)
        servers[0].publish(state)
        downloaded = None
        deadline = time.monotonic() + 30
        while downloaded is None and time.monotonic() < deadline:  # the donor's declaration reaches the DHT
            downloaded = servers[1].download(timeout_s=5.0)
        assert downloaded is not None and downloaded.fragment_rounds == [4] and downloaded.inner_step == 80
        assert all(torch.equal(a, b) for a, b in zip(downloaded.global_params, state.global_params))
        assert servers[2].download(timeout_s=3.0) is None
    finally:
        for server in servers:
            server.shutdown()


@pytest.mark.swarm
def test_a_download_streams_the_state_of_one_publication(two_dhts: tuple[SwarmRecords, SwarmRecords]) -> None:
    """What hivemind streams to a downloader (``get_current_state``, taken when the download begins) stays the state
    published before, whatever is published while it streams."""
    template = [torch.zeros(shape) for shape in SHAPES]
    server = StateServer(two_dhts[0].dht, plan_of().keys("run", "f00d").state(), template, two_dhts[0])
    try:
        first = SwarmState([torch.full(s, 1.0) for s in SHAPES], [torch.zeros(s) for s in SHAPES], [1], 10, 100)
        server.publish(first)
        _, streamed, _ = server._averager.get_current_state()
        server.publish(SwarmState([torch.full(s, 2.0) for s in SHAPES], [torch.ones(s) for s in SHAPES], [2], 20, 200))
        assert all(torch.equal(tensor, torch.full(shape, 1.0)) for tensor, shape in zip(streamed, SHAPES))
    finally:
        server.shutdown()


@pytest.mark.swarm
def test_on_a_real_dht_units_meet_only_when_their_round_settings_match(
    two_dhts: tuple[SwarmRecords, SwarmRecords],
) -> None:
    """Two units that differ in their outer lr begin rounds at the same time and complete alone; with the same
    round settings (another matchmaking window) they average together."""
    first_dht, second_dht = (peer.dht for peer in two_dhts)
    template = [torch.zeros(8)]

    def averager(dht: hivemind.DHT, run_id: str, plan: RoundPlan) -> OuterAverager:
        prefix = plan.keys(run_id, "f00d").fragment_round(0)
        return OuterAverager(dht, prefix, template, quorum=1, target_group_size=2, allreduce_timeout_s=10)

    def sizes(first: OuterAverager, second: OuterAverager) -> list[int]:
        for value, member in ((1.0, first), (3.0, second)):
            assert member.begin_round([torch.full((8,), value)], weight=1.0, outer_round=0, window_s=3.0)
        outcomes = [member.finish_round(timeout_s=20.0) for member in (first, second)]
        return [outcome.group_size if outcome is not None else 0 for outcome in outcomes]

    pairs = [
        (averager(first_dht, "differ", plan_of()), averager(second_dht, "differ", plan_of(outer_lr=0.5))),
        (averager(first_dht, "match", plan_of()), averager(second_dht, "match", plan_of(window_fraction=0.1))),
    ]
    try:
        assert sizes(*pairs[0]) == [1, 1]
        assert sizes(*pairs[1]) == [2, 2]
    finally:
        for pair in pairs:
            for member in pair:
                member.shutdown()


# ------------------------------------------------------------------------------------------------ torch only
def test_the_round_machinery_imports_neither_hivemind_nor_transformers() -> None:
    """The rounds package and the algorithm it runs are torch only: a fresh interpreter that imports every module of
    them has neither hivemind nor transformers loaded."""
    package = Path(p2p_diloco.rounds.__file__).parent
    modules = [f"p2p_diloco.rounds.{path.stem}" for path in sorted(package.glob("*.py")) if path.stem != "__init__"]
    modules += ["p2p_diloco.diloco", "p2p_diloco.fragments", "p2p_diloco.streaming", "p2p_diloco.robust"]
    script = f"import sys\nfor name in {modules!r}:\n    __import__(name)\n"
    script += "print(sorted(name for name in ('hivemind', 'transformers') if name in sys.modules))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert len(modules) >= 9 and result.stdout.strip() == "[]", result.stdout + result.stderr
