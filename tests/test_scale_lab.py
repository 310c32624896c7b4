"""The swarm-scale laboratory's arithmetic (bench/scale.py) and the simulator (bench/simulate.py), without swarms."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from bench.quality import EvalPoint, Method, MethodResult
from bench.scale import one_model_share, percentile, timeline
from bench.simulate import TICK_S, Matchmaker, SimAverager, SimSpec, Simulation
from bench.swarm_quality import loss_at, read_swarm
from p2p_diloco.rounds.averager import GroupRequest
from p2p_diloco.rounds.grid import Leader
from p2p_diloco.settings import load_config
from p2p_diloco.unit.events import Eval, InnerStep, ModelProbe, OuterRound
from p2p_diloco.unit.metrics import MetricsLog


def test_percentiles() -> None:
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0 and percentile([], 0.9) is None


def test_the_timeline_takes_each_units_latest_probe() -> None:
    first, turned = (
        ModelProbe(time=10.0, outer_round=0, values=[1.0, 0.0]),
        ModelProbe(time=12.0, outer_round=1, values=[0.0, 1.0]),
    )
    probes = {"u0": [first, turned], "u1": [ModelProbe(time=10.5, outer_round=0, values=[1.0, 0.0])]}
    points = timeline(probes, start=11.0, end=13.0)
    assert [p["max"] for p in points] == pytest.approx([0.0, 2**0.5, 2**0.5])
    assert points[0]["clusters"] == [2] and points[1]["clusters"] == [1, 1]


def test_the_one_model_share_counts_from_the_given_time() -> None:
    points = [{"t": 0.0, "clusters": [1, 1]}, {"t": 1.0, "clusters": [2]}, {"t": 2.0, "clusters": [1, 1]}]
    assert one_model_share(points, 0.0) == pytest.approx(1 / 3)
    assert one_model_share(points, 1.0) == pytest.approx(1 / 2) and one_model_share(points, 3.0) is None


def test_the_matchmaker_forms_groups_by_hiveminds_rule() -> None:
    """The earliest scheduled unit leads the units that waited long enough to be found, earliest scheduled first, up
    to the target size; a unit alone at its scheduled time completes alone."""
    matchmaker = Matchmaker(target_group=2, latency_s=1.0, latency_per_member_s=0.0, miss=0.0, rng=random.Random(0))
    units = [SimAverager(matchmaker, "key", [torch.zeros(2)]) for _ in range(5)]

    def begin(index: int, window_s: float) -> None:
        units[index].begin_round([torch.full((2,), float(index))], weight=1.0, outer_round=index, window_s=window_s)

    for index in range(3):
        begin(index, 3.0 + index)  # scheduled at 3, 4 and 5
    matchmaker.advance(2.5)
    begin(3, 2.0)  # scheduled at 4.5
    matchmaker.advance(4.0)
    begin(4, 3.0)  # scheduled at 7, begun too late to be found by the group at 4.5
    for now in (4.5, 5.5, 7.0, 8.0):
        matchmaker.advance(now)
    outcomes = [unit.poll() for unit in units]
    assert all(outcome is not None for outcome in outcomes)
    sizes = [outcome.group_size for outcome in outcomes if outcome is not None]
    assert sizes == [2, 2, 2, 2, 1] and matchmaker.groups == [2, 2, 1]
    first, second = outcomes[0], outcomes[3]
    assert first is not None and torch.equal(first.averaged[0], torch.full((2,), 0.5))  # units 0 and 1
    assert second is not None and torch.equal(second.averaged[0], torch.full((2,), 2.5))  # units 3 (leader) and 2
    assert [outcome.position for outcome in outcomes if outcome is not None][:2] == [0, 1]


@pytest.mark.parametrize(("hinted", "miss", "sizes"), [(False, 0.0, [1, 1]), (True, 0.0, [2, 2]), (True, 1.0, [1, 1])])
def test_a_unit_asking_hinted_leaders_needs_only_to_have_begun_and_a_miss_leaves_it_alone(
    hinted: bool, miss: float, sizes: list[int]
) -> None:
    """A unit that begins 0.5 s before its leader's scheduled time joins the group only when it asks the hinted
    leaders at once (a grid row's), and not when it misses it (the fitted probability of everything else)."""
    matchmaker = Matchmaker(target_group=2, latency_s=1.0, latency_per_member_s=0.0, miss=miss, rng=random.Random(0))
    leader, late = (SimAverager(matchmaker, "key", [torch.zeros(2)]) for _ in range(2))
    leader.begin_round([torch.zeros(2)], weight=1.0, outer_round=0, window_s=3.0)
    matchmaker.advance(2.5)
    hints = (Leader("leader", -0.05),) if hinted else ()
    late.begin_round([torch.ones(2)], 1.0, 0, window_s=0.55, group=GroupRequest(leaders=hints))
    for now in (3.0, 3.05, 4.1):
        matchmaker.advance(now)
    outcomes = [leader.poll(), late.poll()]
    assert [outcome.group_size for outcome in outcomes if outcome is not None] == sizes


def test_churn_is_a_percentage_of_the_units_per_hour() -> None:
    """10 %/h of 360 units: 36 leave (and as many join) per hour, one every 100 s (a bug had taken 10 %/h as 10 per
    unit per hour: 100 times too many joins in the predictions)."""
    simulation = Simulation(SimSpec(units=360, target_group=8, churn_per_hour=10.0))
    assert simulation.leave_probability * 3600 / TICK_S == pytest.approx(36)


@pytest.mark.parametrize("schedule", ["steps", "clock"])
def test_a_small_simulated_swarm_trains_and_meets(schedule: str) -> None:
    result = Simulation(SimSpec(units=4, target_group=4, schedule=schedule, duration_s=40.0, step_jitter=0.0)).run()
    assert result["mean_group"] > 2 and sum(result["group_sizes"].values()) >= 8
    assert result["bytes_sent_per_unit_per_hour"] > 0 and result["distance_during"]["p50"] is not None


def test_a_kept_swarm_run_is_read_as_its_tokens_evals_and_rounds(tmp_path: Path) -> None:
    """Two units of a kept run: tokens are every unit's steps × tokens per step (from run.json), the mid-run evals
    the last each reported before the swarm's steps reached half their total, the alone share and overlap from the
    rounds; an in-process curve is read between its eval points."""
    config = load_config(preset="tiny").model_dump(mode="json")
    per_step = config["data"]["seq_len"] * config["data"]["batch_size"]
    for unit, steps in (("unit0", 10), ("unit1", 6)):
        (tmp_path / unit).mkdir()
        (tmp_path / unit / "run.json").write_text(json.dumps({"config": config}))
        log = MetricsLog(tmp_path / unit / "metrics.jsonl")
        for step in range(1, steps + 1):
            log.write(InnerStep(time=100.0 + step, step=step, loss=None, seconds=0.1))
            if step % 3 == 0:
                log.write(Eval(time=100.2 + step, reason="outer_round", outer_round=step // 3, eval_loss=10.0 - step))
        round_fields = dict(fragment=0, outer_round=1, unit_outer_round=1, seconds=1.0, weight=1, member_drift=0.0,
                            useful_compute_s=1.0, useful_tokens=1)  # fmt: skip
        log.write(OuterRound(time=200.0, status="merged", group_size=2, overlap_steps=4, **round_fields))
        log.write(OuterRound(time=201.0, status="alone", group_size=1, overlap_steps=2, **round_fields))
        log.write(Eval(time=300.0, reason="final", outer_round=2, eval_loss=float(steps)))
        log.close()
    swarm = read_swarm(tmp_path)
    assert swarm.units == 2 and swarm.tokens == 16 * per_step and swarm.steps_per_unit == (10, 6)
    assert swarm.final_evals == (10.0, 6.0) and swarm.alone_share == 0.5 and swarm.overlap_steps == 3
    assert swarm.mid_evals == (7.0, 7.0)  # half of 16 steps at t=105 (unit0's 5th): both units' evals of step 3
    assert swarm.mid_tokens == 6 * per_step  # each reported at 103.2: steps 1-3 of both units were done
    assert swarm.settings["outer__inner_steps"] == config["outer"]["inner_steps"]
    curve = MethodResult(Method("m", "diloco", 2), 100, 10, 1, 2.0, (EvalPoint(0, 9.0), EvalPoint(100, 7.0)), 0.0)
    assert loss_at(curve, 50) == 8.0 and loss_at(curve, 150) == 7.0
