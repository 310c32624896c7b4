"""The swarm clock (rounds/clock.py) and the round engine on the clock schedule and at exit, against fakes."""

from __future__ import annotations

import math

import pytest
import torch
from fakes import FakeGroup, TimedGroup, clone_all

from p2p_diloco.config import OuterSection
from p2p_diloco.rounds.averager import GroupRequest, RoundOutcome
from p2p_diloco.rounds.clock import ADOPT_ROUNDS, RoundClock, next_boundary, power_of_two_period
from p2p_diloco.rounds.departure import settle_period_s, settle_window_s, together_boundary
from p2p_diloco.rounds.engine import RoundEngine
from p2p_diloco.rounds.kinds import Settle
from p2p_diloco.rounds.plan import RoundPlan
from p2p_diloco.rounds.results import RoundEnd, RoundId, RoundKind, RoundStatus
from p2p_diloco.rounds.schedule import ClockSchedule

SHAPES = [(8, 4), (4,)]
TOKENS = 10


def clock_of(inner_steps: int = 20, fragments: int = 1) -> RoundClock:
    return RoundClock(inner_steps, fragments, min_window_s=2.0, min_period_s=4.0)


def test_periods_are_the_nearest_power_of_two_and_their_boundaries_nest() -> None:
    assert [power_of_two_period(s) for s in (0.3, 1.0, 5.0, 6.0, 11.0)] == [0.25, 1.0, 4.0, 8.0, 8.0]
    with pytest.raises(ValueError):
        power_of_two_period(0.0)
    now = 1_000_003.0
    slow = next_boundary(now, 16.0, 0.0)
    assert slow % 16 == 0 and slow > now
    assert slow % 8 == 0 and slow % 4 == 0, "a slower unit's boundaries are boundaries of the faster ones"


def test_the_period_follows_the_step_time_with_hysteresis_and_always_fits_a_round() -> None:
    clock = clock_of()
    assert clock.update(0.3) == 8.0  # 20 × 0.3 s = 6 s
    assert clock.update(0.5) == 8.0, "10 s stays within the hysteresis of 8 s"
    assert clock.update(0.9) == 16.0
    assert clock.update(0.05) == 4.0, "never below the minimum period"
    assert clock.update(0.05, busy_s=7.0) == 16.0, "a round busy for 7 s after its boundary needs a longer period"


def test_a_round_is_due_within_the_lead_of_its_boundary_and_until_shortly_before_it() -> None:
    clock = clock_of()
    clock.update(0.3)  # period 8 s, lead 2.6 s (two steps)
    assert clock.due_boundary(0, now=1000.0 - 3.0, step_time_s=0.3, after=-math.inf) is None  # 3 s before 1000
    assert clock.due_boundary(0, now=1000.0 - 2.5, step_time_s=0.3, after=-math.inf) == 1000.0
    assert clock.due_boundary(0, now=1000.0 - 1.0, step_time_s=0.3, after=-math.inf) == 1000.0, "late, still in"
    assert clock.due_boundary(0, now=1000.0 - 0.2, step_time_s=0.3, after=-math.inf) is None, "too close: next one"
    assert clock.due_boundary(0, now=1000.0 - 2.2, step_time_s=0.3, after=1000.0) is None, "that boundary's round ran"


def test_a_unit_follows_the_longest_period_its_group_wants_within_bounds() -> None:
    clock = clock_of()
    clock.update(0.3)  # wants 8 s
    clock.adopt([8.0, 0.0, 30.0])  # 30 s counts as 32 (a power of two); 0: a member without a clock
    assert clock.period_s == 32.0 and clock.desired_s == 8.0
    clock.adopt([8.0, 1e9])
    assert clock.period_s == 64.0, "never more than 8 times its own period: a stranger cannot stall it"
    for rounds in range(1, ADOPT_ROUNDS + 1):
        clock.adopt([4.0])
        assert (clock.period_s == 8.0) == (rounds == ADOPT_ROUNDS), "back to its own after ADOPT_ROUNDS rounds"


def test_a_unit_follows_the_longest_period_the_census_wants_within_bounds() -> None:
    """The live units' progress records reach every unit (rows do not): the longest period they want is followed, a
    stranger's huge claim no further than 8 times the unit's own; a census that no longer wants it lets it go."""
    clock = clock_of()
    clock.update(0.3)  # wants 8 s
    clock.follow_census([8.0, 16.0, 0.0])
    assert clock.period_s == 16.0
    clock.follow_census([8.0, 1e9])
    assert clock.period_s == 64.0, "a stranger claiming a huge period slows it by MAX_ADOPTED at most"
    clock.follow_census([8.0])
    assert clock.period_s == 8.0


def test_fragments_are_staggered_over_the_period() -> None:
    clock = clock_of(fragments=2)
    clock.update(0.3)
    assert clock.boundary(0, 1001.0) == 1008.0 and clock.boundary(1, 1001.0) == 1004.0


# --------------------------------------------------------------------------------------------------- engine
def plan_of(**outer: object) -> RoundPlan:
    return RoundPlan.from_config(OuterSection(**{"schedule": "clock", **outer}), SHAPES)  # type: ignore[arg-type]


def engines(count: int, plan: RoundPlan, group: FakeGroup | TimedGroup) -> list[RoundEngine]:
    result = []
    for unit in range(count):
        torch.manual_seed(unit)
        local = [torch.randn(shape) for shape in SHAPES]
        averagers = [group.averager(template, f"u{unit}") for template in plan.round_templates(local)]
        result.append(RoundEngine(plan, averagers, local=local, peer_id=f"u{unit}"))
    census = dict.fromkeys((engine.peer_id for engine in result), 0.0)
    for engine in result:
        engine.census = census
    return result


def step(engine: RoundEngine, amount: float) -> None:
    with torch.no_grad():
        for tensor in engine.state.local:
            tensor.add_(amount)
    engine.record_step(TOKENS, 0.1)


@pytest.mark.parametrize(("error", "busy_s", "period_s"), [(None, 30.0, 32.0), ("AllreduceException", 1.0, 2.0)])
def test_a_round_that_ended_in_an_error_cannot_stretch_the_period_beyond_h_steps(
    error: str | None, busy_s: float, period_s: float
) -> None:
    """A round that took 30 s after its boundary: when it completed, rounds need that long and the period grows to
    hold it; when its all-reduce ended in an error (a timed-out member, measured: 8 units went to 64-128 s periods
    after one), it counts at most as long as H inner steps take (here 10 × 0.1 s), or the busy time measured before."""
    plan = plan_of(inner_steps=10, min_window_s=1.0, max_window_s=1.0)
    schedule = ClockSchedule(plan, plan.clock(), "u0")  # type: ignore[arg-type]
    schedule.fragments_due([], set(), 1, 0.1, 100.0, {})  # a step time measured: the clock has a period
    schedule.last_boundary[0] = 100.0
    alone = RoundOutcome([torch.zeros(1)], 1, 0, 1.0, 100.0, 130.0, error=error)
    schedule.fragment_ended(0, alone)
    schedule.fragments_due([], set(), 1, 0.1, 130.0, {})
    assert schedule.busy_s == busy_s and schedule.period_s == period_s


def test_units_of_different_speeds_meet_at_every_boundary_of_the_shared_clock() -> None:
    """A fast unit (0.1 s steps) and a slow one (0.3 s) on the clock schedule, H = 10: their own steps would put their
    rounds every 1 and 3 s, and their phases would drift apart. On the clock the fast one follows the slow one's
    period (4 s) once they met, and from then on they meet at every boundary and hold the same φ."""
    group = TimedGroup()
    plan = plan_of(inner_steps=10, min_window_s=0.5)
    fast, slow = engines(2, plan, group)
    begun: dict[str, list[float]] = {"fast": [], "slow": []}
    now = 10_000.0
    for tick in range(1, 601):  # 60 s in ticks of 0.1 s
        now += 0.1
        group.advance(now)
        for name, engine, every, step_time in (("fast", fast, 1, 0.1), ("slow", slow, 3, 0.3)):
            if tick % every:
                continue
            step(engine, 0.01 * (1 + every))
            engine.poll()
            for begin in engine.begin_due(step_time, now):
                if begin.status is RoundStatus.BEGUN and begin.kind is RoundKind.FRAGMENT:
                    begun[name].append(round(now + begin.window_s))
    assert isinstance(fast.schedule, ClockSchedule) and isinstance(slow.schedule, ClockSchedule)
    assert slow.schedule.period_s == fast.schedule.period_s == 4.0
    assert not any(b.tag == "mix" for r in group.rounds for b in r.values()), "two units fit in one group: no mix"
    settled = [boundary for boundary in begun["slow"] if boundary > 10_010]
    assert len(settled) >= 10 and set(settled) <= set(begun["fast"])
    together = [r for r in group.rounds if len(r) == 2 and all(b.tag != "mix" for b in r.values())]
    assert len(together) >= len(settled) - 1, "each slow round met the fast one (the last may be in flight)"
    assert all(torch.equal(a, b) for a, b in zip(fast.state.global_params, slow.state.global_params))


def test_the_period_grows_with_h_over_the_warm_up_rounds() -> None:
    """H = 40 inner steps of 0.1 s with two warm-up rounds: the rounds after outer rounds 0, 1 and 2 come after 10, 20
    and 40 steps' time, so the period goes 1, 2 and then 4 s (at least the two 0.5-s windows)."""
    group = TimedGroup()
    plan = plan_of(inner_steps=40, warmup_rounds=2, min_window_s=0.5, max_window_s=0.5)
    units = engines(2, plan, group)
    periods: list[float] = []
    now = 20_000.0
    for _ in range(200):  # 20 s in steps of 0.1 s
        now += 0.1
        group.advance(now)
        for engine in units:
            step(engine, 0.01)
            engine.poll()
            engine.begin_due(0.1, now)
        schedule = units[0].schedule
        assert isinstance(schedule, ClockSchedule)
        if schedule.period_s is not None and (not periods or periods[-1] != schedule.period_s):
            periods.append(schedule.period_s)
    assert periods == [1.0, 2.0, 4.0] and units[0].outer_round >= 4
    assert all(torch.equal(a, b) for a, b in zip(units[0].state.global_params, units[1].state.global_params))


def settle_template(engine: RoundEngine) -> list[torch.Tensor]:
    return Settle(engine.state).template()


def test_settle_rounds_bring_units_that_leave_together_to_their_mean_phi() -> None:
    plan = plan_of()
    units = engines(3, plan, FakeGroup())
    settle = FakeGroup()
    averagers = [settle.averager(settle_template(unit), f"u{index}") for index, unit in enumerate(units)]
    for offset, unit in enumerate(units):
        with torch.no_grad():
            for phi in unit.state.global_params:
                phi.add_(offset)  # three different models
    mean = [torch.stack(tensors).mean(0) for tensors in zip(*(unit.state.global_params for unit in units))]
    local_before = [[tensor.clone() for tensor in unit.state.local] for unit in units]
    phi_before = [[tensor.clone() for tensor in unit.state.global_params] for unit in units]
    kinds = [Settle(unit.state) for unit in units]
    sent = [
        kind.begin(0, averager, window_s=settle_window_s(plan, 1000.0))[1] for kind, averager in zip(kinds, averagers)
    ]
    payload = sent[0]  # φ itself, in its shapes: a settle round copies the model only into its averager's buffers
    assert payload is not None and all(
        tensor.data_ptr() == phi.data_ptr() for tensor, phi in zip(payload, units[0].state.global_params)
    )
    assert all(tensor.device.type == "meta" for tensor in settle_template(units[0]))
    ends = [kind.end(0, payload, averager.poll()) for kind, payload, averager in zip(kinds, sent, averagers)]
    assert all(end.kind is RoundKind.SETTLE and end.status is RoundStatus.MERGED for end in ends)
    assert ends[0].member_drift > 0.1
    for index, unit in enumerate(units):
        assert all(torch.allclose(phi, target, atol=1e-6) for phi, target in zip(unit.state.global_params, mean))
        for theta, theta0, phi0, phi in zip(unit.state.local, local_before[index], phi_before[index],
                                            unit.state.global_params):  # fmt: skip
            assert torch.allclose(theta - theta0, phi - phi0, atol=1e-6), "θ moves with φ: local progress is kept"
        assert unit.outer_round == 0


def test_a_settle_round_that_meets_nobody_or_ends_late_changes_nothing() -> None:
    (unit,) = engines(1, plan_of(), FakeGroup())
    settle = Settle(unit.state)
    averager = FakeGroup().averager(settle_template(unit), "alone")
    before = [tensor.clone() for tensor in unit.state.global_params]
    _, sent = settle.begin(0, averager, window_s=2.0)
    end = settle.end(0, sent, averager.poll())
    assert end.status is RoundStatus.ALONE and all(torch.equal(a, b) for a, b in zip(unit.state.global_params, before))
    other = FakeGroup()
    first, _second = other.averager(settle_template(unit), "a"), other.averager(settle_template(unit), "b")
    assert settle.begin(0, first, window_s=2.0)[1] is not None
    assert first.finish_round(0.0) is None  # the other member never came
    late = settle.late()
    assert late.status is RoundStatus.FAILED and all(
        torch.equal(a, b) for a, b in zip(unit.state.global_params, before)
    )


def test_the_settle_grid_is_shared_whatever_the_period() -> None:
    plan = plan_of(min_window_s=2.0)
    for now in (1000.0, 1001.5, 1003.9):
        window = settle_window_s(plan, now)
        assert window >= 2.0 and (now + window) % 4.0 == pytest.approx(0.0)
    early, late = settle_window_s(plan, 1000.0, not_before=1010.0), settle_window_s(plan, 1009.0, not_before=1010.0)
    assert 1000.0 + early == 1009.0 + late == 1016.0, "units that drained at different times settle together"


def mixing_units(outer_momentum: float) -> tuple[TimedGroup, list[RoundEngine]]:
    """Four units on the clock schedule in rows of at most two (more live units than the target: the mix stage
    runs)."""
    group = TimedGroup(target_size=3)  # the matchmaking cap of a target of two
    plan = plan_of(inner_steps=10, min_window_s=0.5, target_group_size=2, outer_momentum=outer_momentum)
    return group, engines(4, plan, group)


def tick(group: TimedGroup, units: list[RoundEngine], now: float) -> list[RoundEnd]:
    """0.1 s later: every unit trains a step (unit i on i + 1 times the tokens of unit 0), merges what ended and
    begins what is due; the rounds that ended."""
    group.advance(now)
    ends = []
    for index, engine in enumerate(units):
        engine.record_step(TOKENS * (index + 1), 0.1)  # unequal weights
        ends += engine.poll()
        engine.begin_due(0.1, now)
    return ends


@pytest.mark.parametrize("outer_momentum", [0.0, 0.9], ids=["plain average", "momentum synced"])
def test_the_mix_stage_brings_groups_smaller_than_the_swarm_to_the_exact_weighted_mean(outer_momentum: float) -> None:
    """Four units in rows of two: after a fragment round they hold two row means; half a period later the mix round
    pairs the first units of both rows and the second units of both, weighted by their rows' tokens, so all four hold
    the weighted mean of the four proposals (and of their momenta): synchronous DiLoCo's φ."""
    group, units = mixing_units(outer_momentum)
    now, mixed = 10_000.0, []
    while len(mixed) < 4 and now < 10_030.0:
        now += 0.1
        mixed += [end for end in tick(group, units, now) if end.kind is RoundKind.MIX]
    assert [end.status for end in mixed] == [RoundStatus.MERGED] * 4 and {end.group_size for end in mixed} == {2}
    assert all(isinstance(engine.schedule, ClockSchedule) and engine.schedule.clock.rounds_per_period == 2
               for engine in units)  # fmt: skip
    mixes = [index for index, r in enumerate(group.rounds) if any(b.tag == "mix" for b in r.values())]
    first = group.rounds[mixes[0] - 2 : mixes[0]]  # the two groups of the fragment round before the mix
    begun = [b for r in first for b in r.values()]
    assert len(begun) == 4 and all(b.tag != "mix" for b in begun)
    total = sum(b.weight for b in begun)
    expected = [sum(b.weight * b.proposal[i] for b in begun) / total for i in range(len(begun[0].proposal))]
    count = len(SHAPES)
    for engine in units:
        assert all(
            torch.allclose(phi, want, atol=1e-5) for phi, want in zip(engine.state.global_params, expected[:count])
        )
        assert all(torch.allclose(m, want, atol=1e-5) for m, want in zip(engine.state.momentum, expected[count:]))
    assert len(units[0].state.momentum) == (count if outer_momentum else 0)


def test_final_rounds_begin_while_a_mix_round_is_in_flight() -> None:
    """A unit leaving half a period after a fragment round cancels its mix round in flight (it carries no progress)
    and hands its last steps to a final round on the same averager."""
    group, units = mixing_units(outer_momentum=0.9)
    now = 10_000.0
    while not any(mixing(engine) for engine in units) and now < 10_030.0:
        now += 0.1
        tick(group, units, now)
    leaving = next(engine for engine in units if mixing(engine))
    leaving.record_step(TOKENS, 0.1)
    begins = leaving.begin_final(0.1, now)
    assert isinstance(leaving.schedule, ClockSchedule)
    assert not mixing(leaving) and not leaving.schedule.mix_due
    assert [begin.status for begin in begins] == [RoundStatus.BEGUN]


def test_a_round_in_flight_at_exit_merges_at_once_and_the_steps_made_meanwhile_go_in_one_more_final_round() -> None:
    """A unit leaving while its fragment round is in flight, in rows (a mix round would follow): the drain merges the
    round into φ at once (no mix round runs at exit), and the steps made while it ran are handed over by the next
    final round."""
    group, units = mixing_units(outer_momentum=0.0)
    leaving, now = units[0], 10_000.0
    fragment_round = RoundId(RoundKind.FRAGMENT, 0)
    while fragment_round not in leaving.in_flight and now < 10_030.0:
        now += 0.1
        tick(group, units, now)
    step(leaving, 0.5)  # trained while the round is in flight
    group.advance(now + 10.0)  # every round scheduled ends
    before = clone_all(leaving.state.global_params)
    (end,) = leaving.drain(timeout_s=1.0)
    assert end.merged and not leaving.state.held and not leaving.schedule.mix_pending(0)
    assert any(not torch.equal(old, new) for old, new in zip(before, leaving.state.global_params))
    assert [begin.status for begin in leaving.begin_final(0.1, now + 10.0)] == [RoundStatus.BEGUN]
    assert leaving.begin_final(0.1, now + 10.0) == []  # in flight: nothing more to hand over


def test_units_leaving_together_end_on_one_phi_in_one_final_round() -> None:
    """Every unit of a swarm in rows leaves while the rows' merges wait for their mix round: the merges are applied
    (two row means), then one final round per unit, all of them in one group at the boundary every unit derives from
    the same announcements, tokens or not, brings all four to one φ."""
    group, units = mixing_units(outer_momentum=0.9)
    now = 10_000.0
    while not any(engine.state.held for engine in units) and now < 10_030.0:
        now += 0.1
        tick(group, units, now)
    while any(engine.in_flight for engine in units):  # the rows' rounds end; their mix rounds are not due yet
        now += 0.1
        tick(group, units, now)
    plan = units[0].plan
    boundary = together_boundary(plan, [now - 0.3, now - 0.1, now])
    assert boundary >= now + 2 * settle_period_s(plan) and boundary % settle_period_s(plan) == pytest.approx(0.0)
    together = GroupRequest(size=4, scheduled_at=boundary)
    units[3].state.fragments[0].tokens_since_round = 0  # nothing to hand over: it takes part all the same
    begins = [begin for engine in units for begin in engine.begin_final(0.1, now, together)]
    assert [begin.status for begin in begins] == [RoundStatus.BEGUN] * 4
    group.advance(boundary + 1.0)
    ends = [end for engine in units for end in engine.drain(timeout_s=1.0)]  # as departure.py ends them
    assert all(end.merged and end.group_size == 4 for end in ends) and len(ends) == 4
    assert all(not engine.state.held and not engine.in_flight for engine in units)
    for engine in units[1:]:
        assert all(torch.equal(a, b) for a, b in zip(engine.state.global_params, units[0].state.global_params))


def mixing(engine: RoundEngine) -> bool:
    """Whether a mix round is in flight."""
    return any(round_id.kind is RoundKind.MIX for round_id in engine.in_flight)
