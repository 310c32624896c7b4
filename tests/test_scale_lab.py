"""The swarm-scale laboratory's arithmetic (bench/scale.py) and the simulator (bench/simulate.py), without swarms."""

from __future__ import annotations

import pytest
import torch

from bench.scale import one_model_share, percentile, timeline
from bench.simulate import Matchmaker, SimAverager, SimSpec, Simulation
from p2p_diloco.unit.events import ModelProbe


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
    matchmaker = Matchmaker(target_group=2, latency_s=1.0, latency_per_member_s=0.0)
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


@pytest.mark.parametrize("schedule", ["steps", "clock"])
def test_a_small_simulated_swarm_trains_and_meets(schedule: str) -> None:
    result = Simulation(SimSpec(units=4, target_group=4, schedule=schedule, duration_s=40.0, step_jitter=0.0)).run()
    assert result["mean_group"] > 2 and sum(result["group_sizes"].values()) >= 8
    assert result["bytes_sent_per_unit_per_hour"] > 0 and result["distance_during"]["p50"] is not None
