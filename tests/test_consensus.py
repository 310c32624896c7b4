"""The swarm's consensus from the φ probes in the units' progress records (p2p_diloco/consensus.py): against a
hand-written reference, in the records, in ``status``, the dashboard, the console and the trackers, and in what a
unit publishes."""

from __future__ import annotations

import logging
import math

import pydantic.v1 as pydantic
import pytest
import torch
from fakes import FakeGroup
from test_records import progress
from unit_peers import PeerFactory

from p2p_diloco.consensus import (
    RECORD_PROBE_SIZE,
    SwarmConsensus,
    lineage_sizes,
    pairwise_distances,
    record_probe,
    swarm_consensus,
)
from p2p_diloco.ops.dashboard import SwarmHistory
from p2p_diloco.ops.status import format_table, swarm_snapshot
from p2p_diloco.unit import events
from p2p_diloco.unit import unit as unit_module
from p2p_diloco.unit.tracking import RoundLines, event_scalars


def reference(probes: list[list[float]], tolerance: float) -> tuple[float, int]:
    """The consensus distance and lineage count written out with plain Python: mean distance to the mean over the
    mean's norm; two units linked when within ``tolerance`` × the larger of their norms, lineages the linked groups."""
    count, length = len(probes), len(probes[0])
    mean = [sum(probe[index] for probe in probes) / count for index in range(length)]
    distance = sum(math.dist(probe, mean) for probe in probes) / count / math.hypot(*mean)
    group = list(range(count))
    for _ in range(count):  # propagate the smallest index along links until nothing changes
        for a in range(count):
            for b in range(count):
                scale = max(math.hypot(*probes[a]), math.hypot(*probes[b]))
                if math.dist(probes[a], probes[b]) <= tolerance * scale:
                    group[a] = group[b] = min(group[a], group[b])
    return distance, len(set(group))


@pytest.mark.parametrize(
    "probes",
    [
        [[1.0, 2.0, 3.0]],
        [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0 + 1e-9], [1.3, 2.0, 2.7]],  # two lineages one step apart
        [[1.0, 0.0], [1.0008, 0.0], [1.0016, 0.0], [5.0, 5.0]],  # a chain of close pairs is one lineage
        [[0.5, -1.0, 2.0, 0.0], [0.6, -1.0, 2.0, 0.0], [0.5, -1.1, 2.0, 0.0], [0.5, -1.0, 2.0, 0.1]],
    ],
)
def test_the_consensus_matches_the_reference(probes: list[list[float]]) -> None:
    distance, lineages = reference(probes, tolerance=1e-3)
    consensus = swarm_consensus(probes)
    assert consensus.units == len(probes) and consensus.lineages == lineages
    assert consensus.distance == pytest.approx(distance, rel=1e-12, abs=1e-15)


def test_distances_and_lineages_at_the_tolerance() -> None:
    a, b, c = torch.tensor([1.0, 0.0]), torch.tensor([1.0, 5e-4]), torch.tensor([0.0, 1.0])
    assert pairwise_distances([a, b, c]) == pytest.approx([5e-4, 2**0.5, (1 + (1 - 5e-4) ** 2) ** 0.5], rel=1e-4)
    assert lineage_sizes(3, pairwise_distances([a, b, c])) == [2, 1]
    assert lineage_sizes(2, pairwise_distances([a, b])) == [2]
    assert lineage_sizes(2, pairwise_distances([a, c])) == [1, 1]


def test_probes_of_older_peers_or_another_length_are_left_out() -> None:
    probes = [[1.0, 2.0], [], [1.0, 2.0], [9.0, 9.0, 9.0]]
    assert swarm_consensus(probes) == SwarmConsensus(0.0, 1, 2)
    assert swarm_consensus([[], []]) == SwarmConsensus(0.0, 0, 0)


def test_a_record_probe_is_spread_over_the_probe_and_finite() -> None:
    probe = [float(index) for index in range(1024)]
    assert record_probe(probe) == [float(32 * index) for index in range(RECORD_PROBE_SIZE)]
    assert record_probe(probe[:5]) == probe[:5]
    assert record_probe([1.0, math.nan]) == []


@pytest.mark.parametrize("probe", [[0.0] * (RECORD_PROBE_SIZE + 1), [math.inf], ["1.0"]])
def test_a_record_with_a_malformed_probe_is_refused(probe: list) -> None:
    with pytest.raises(pydantic.ValidationError):
        progress("a", probe=probe)


def test_status_and_the_dashboard_show_how_many_models_the_live_peers_hold() -> None:
    now = 1000.0
    rows = [progress("a", last_seen=now, probe=[1.0, 2.0]), progress("b", last_seen=now, probe=[1.0, 2.0]),
            progress("c", last_seen=now, probe=[1.5, 2.0]),
            progress("d", last_seen=now - 600, probe=[9.0, 9.0])]  # stale: not counted  # fmt: skip
    live = swarm_consensus([[1.0, 2.0], [1.0, 2.0], [1.5, 2.0]])
    swarm = swarm_snapshot("run", rows, now)["swarm"]
    assert swarm["lineages"] == 2 and swarm["consensus_distance"] == live.distance
    expected = f"swarm consensus: 3 live peers hold 2 models (consensus distance {live.distance:.2g})"
    assert format_table(rows, now, stale_after_s=60).splitlines()[-1] == expected
    history = SwarmHistory("run")
    history.add(rows, now)
    history.add(rows[:2], now + 10)
    assert history.view()["history"]["lineages"] == [2, 1]


def test_the_console_says_when_the_number_of_models_changes_and_the_trackers_get_every_census(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lines = RoundLines(fragments=1)
    caplog.set_level(logging.INFO, logger="p2p_diloco.unit.tracking")
    for lineages in (3, 3, 1, 1):
        lines.write(events.SwarmConsensus(distance=0.1 if lineages > 1 else 1e-9, lineages=lineages, units=8))
    said = [record.getMessage() for record in caplog.records]
    assert said == ["swarm: 8 training units hold 3 models (consensus distance 0.1)",
                    "swarm: 8 training units hold one model (consensus distance 1e-09)"]  # fmt: skip
    alone = SwarmConsensus(0.0, 1, 1).described("training units")
    assert alone == "1 training unit holds one model (consensus distance 0)"
    scalars = event_scalars(events.SwarmConsensus(distance=0.25, lineages=2, units=4))
    assert scalars == {"swarm/consensus_distance": 0.25, "swarm/lineages": 2.0, "swarm/units": 4.0}
    assert event_scalars(events.SwarmConsensus(distance=0.0, lineages=0, units=0)) == {}


def test_a_unit_publishes_its_probe_and_writes_the_consensus_of_each_census(
    make_peer: PeerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its record carries RECORD_PROBE_SIZE values of its φ probe; a census that shows another training unit one
    outer step away counts two models, one at the same φ one model."""
    monkeypatch.setattr(unit_module, "PROGRESS_EVERY_S", 0.0)  # a record and a census after every step
    a = make_peer("a", FakeGroup(), outer__inner_steps=100)  # no round: φ stays as it is

    def step() -> None:
        a.unit.stepped(a.unit.train_step(a.batches))

    step()
    own = a.records.published[-1].probe
    assert len(own) == RECORD_PROBE_SIZE and own == record_probe(a.unit.state.probe())
    fingerprint = a.unit.loaded.fingerprint
    a.records.publish_progress(progress("b", model_fingerprint=fingerprint, probe=[value + 1.0 for value in own]))
    step()
    a.records.publish_progress(progress("b", model_fingerprint=fingerprint, probe=own))
    step()
    seen = [(event.units, event.lineages) for event in a.events(events.SwarmConsensus)]
    assert seen == [(1, 1), (2, 2), (2, 1)]


def test_a_unit_publishes_its_record_as_soon_as_phi_holds_its_rounds_merge(
    make_peer: PeerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records follow φ: a round's merge publishes the unit's record at once (not PROGRESS_EVERY_S after the last
    one), with the merged φ's probe, so units that merged together show one model in the census."""
    monkeypatch.setattr(unit_module, "PROGRESS_EVERY_S", 10**9)  # no record nor census on the timer
    group = FakeGroup()
    a, b = (make_peer(name, group, outer__inner_steps=2) for name in ("a", "b"))
    for _ in range(3):
        for peer in (a, b):
            peer.unit.stepped(peer.unit.train_step(peer.batches))
    assert a.unit.outer_round == b.unit.outer_round == 1
    published = [a.records.published[-1], b.records.published[-1]]
    assert [record.outer_round for record in published] == [1, 1]
    assert published[0].probe == published[1].probe == record_probe(a.unit.state.probe())
