"""The layout of a round's groups on the clock schedule (rounds/grid.py), and a swarm larger than a group on it."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
import torch
from fakes import TimedGroup
from test_clock import TOKENS, engines, plan_of

from p2p_diloco.rounds.engine import RoundEngine
from p2p_diloco.rounds.grid import SPACING_S, GridCell, grid_cell
from p2p_diloco.rounds.results import RoundKind


def layout(count: int, target: int, salt: str = "0@1000.000") -> dict[str, GridCell]:
    census = [f"peer{index}" for index in range(count)]
    return {peer: grid_cell(census, peer, salt, target) for peer in census}


@pytest.mark.parametrize(("count", "target"), [(1, 8), (4, 8), (8, 8), (8, 3), (6, 2), (16, 8), (23, 5), (64, 8)])
def test_every_unit_derives_the_same_rows_and_columns_and_two_stages_reach_the_weighted_mean(
    count: int, target: int
) -> None:
    """Rows hold at most ``target`` units, differ by at most one, and are led by one unit each; each column holds
    every row exactly once in weight, so averaging rows, then columns weighted by row weight × share, leaves every unit
    on the weighted mean of all (what the mix stage computes)."""
    cells = layout(count, target)
    rows: dict[int, list[str]] = defaultdict(list)
    for peer, cell in cells.items():
        rows[cell.row].append(peer)
    sizes = [len(members) for members in rows.values()]
    assert len(rows) == next(iter(cells.values())).rows and max(sizes) <= target and max(sizes) - min(sizes) <= 1
    for members in rows.values():
        assert sorted(cells[peer].place for peer in members) == list(range(len(members)))
        assert all(cells[peer].row_size == len(members) for peer in members)
        assert len({cells[peer].row_bits for peer in members}) == 1
    assert len({cell.row_bits for cell in cells.values()}) == len(rows)
    generator = torch.Generator().manual_seed(count)
    values = {peer: torch.randn(3, generator=generator) for peer in cells}
    weights = {peer: 1.0 + index for index, peer in enumerate(cells)}
    expected = sum(weights[peer] * values[peer] for peer in cells) / sum(weights.values())
    row_mean = {row: (sum(weights[p] * values[p] for p in members) / sum(weights[p] for p in members),
                      sum(weights[p] for p in members)) for row, members in rows.items()}  # fmt: skip
    if len(rows) == 1:
        assert all(cell.row_bits == cell.column_bits == "" for cell in cells.values())
        assert all(torch.allclose(mean, expected) for mean, _ in row_mean.values())
        return
    columns: dict[str, list[str]] = defaultdict(list)
    for peer, cell in cells.items():
        columns[cell.column_bits].append(peer)
    assert len(columns) == next(iter(cells.values())).columns and all(
        len(c) <= 2 * target - 1 for c in columns.values()
    )
    for members in columns.values():
        shares: dict[int, float] = defaultdict(float)
        for peer in members:
            shares[cells[peer].row] += cells[peer].column_share
        assert shares == pytest.approx(dict.fromkeys(rows, 1.0)), "every row once in weight"
        carried = [(row_mean[cells[p].row][1] * cells[p].column_share, row_mean[cells[p].row][0]) for p in members]
        mean = sum(weight * value for weight, value in carried) / sum(weight for weight, _ in carried)
        assert torch.allclose(mean, expected, atol=1e-6)


def test_the_layout_is_drawn_anew_every_round_and_the_leader_schedules_first() -> None:
    """The rows of one salt are not those of the next (no unit keeps its neighbours); places are one SPACING_S apart,
    the row's leader (place 0) first; the order does not depend on the census's order."""
    first, second = layout(16, 4, "0@1000.000"), layout(16, 4, "0@1008.000")
    together = {frozenset(p for p in first if first[p].row == row) for row in range(4)}
    assert together != {frozenset(p for p in second if second[p].row == row) for row in range(4)}
    assert all(cell.row_offset_s == pytest.approx(cell.place * SPACING_S) for cell in first.values())
    census = list(first)
    random.Random(0).shuffle(census)
    assert all(grid_cell(census, peer, "0@1000.000", 4) == cell for peer, cell in first.items())
    assert grid_cell(["peer1"], "peer0", "0@1000.000", 4) == grid_cell(["peer0", "peer1"], "peer0", "0@1000.000", 4)
    with pytest.raises(ValueError):
        grid_cell([], "peer0", "salt", 0)


def run_swarm(
    count: int, target: int, seconds: float, skip_from: float | None = None
) -> tuple[list[tuple[float, bool]], list[float]]:
    """``count`` units on the clock schedule (steps of 0.1 s that move θ at random, H = 10, unequal tokens) for
    ``seconds``; unit u0 begins
    no round for 4 s (one period) from ``skip_from`` (it keeps training). Returns, each time every unit has ended its
    mix round of a period (nothing in flight), the time and whether all units hold the same φ; and the times at which
    they held different φ."""
    group = TimedGroup(target_size=2 * target - 1)
    units = engines(count, plan_of(inner_steps=10, min_window_s=0.5, target_group_size=target), group)
    generator = torch.Generator().manual_seed(count)
    start = now = 10_000.0
    last: dict[str, RoundKind] = {}
    checks: list[tuple[float, bool]] = []
    apart: list[float] = []
    while now < start + seconds:
        now += 0.1
        if not one_model(units):
            apart.append(now - start)
        group.advance(now)
        for index, engine in enumerate(units):
            for tensor in engine.state.local:  # an inner step: every unit moves θ its own way
                tensor.add_(torch.randn(tensor.shape, generator=generator) * 0.01)
            engine.record_step(TOKENS * (index + 1), 0.1)
            for end in engine.poll():
                last[engine.peer_id] = end.kind
            if skip_from is None or engine.peer_id != "u0" or not skip_from <= now - start < skip_from + 4.0:
                engine.begin_due(0.1, now)
        if len(last) == count and set(last.values()) == {RoundKind.MIX} and not any(e.in_flight for e in units):
            checks.append((now - start, one_model(units)))
            last.clear()
    return checks, apart


def one_model(units: list[RoundEngine]) -> bool:
    reference = units[0].state.global_params
    return all(
        torch.allclose(a, b, atol=1e-6) for engine in units for a, b in zip(engine.state.global_params, reference)
    )


@pytest.mark.parametrize(("count", "target"), [(6, 2), (16, 8), (8, 3)])
def test_a_swarm_larger_than_a_group_ends_every_period_on_one_phi(count: int, target: int) -> None:
    """Rows in the fragment round, columns in the mix round (6 > 2²: columns of three), the row's merge held back
    until the mix round ends: from the first period on (the units start from different φ), all units hold the same φ
    at every moment, and it changes once per period."""
    checks, apart = run_swarm(count, target, 50.0)
    assert len(checks) >= 10 and all(same for _, same in checks)
    assert apart and max(apart) <= checks[0][0], "apart only until the first mix round"


def test_a_unit_that_missed_a_round_is_back_on_the_swarm_phi_within_one_period() -> None:
    """u0 begins no round for one period (from 10 to 14 s): the others move on at the end of that period and it holds
    the old φ; the first period it takes part in again ends with all six on one φ, and so does every later one."""
    checks, apart = run_swarm(6, 2, 50.0, skip_from=10.0)
    back = [(at, same) for at, same in checks if at >= 14.0]
    missed = [at for at in apart if at > checks[0][0]]
    assert missed and 14.0 < min(missed) and max(missed) < 14.0 + 4.0 + 1.0, "apart for at most one period"
    assert back[0][0] < 14.0 + 4.0 + 1.0 and all(same for _, same in back) and len(back) >= 8


@pytest.mark.parametrize(("count", "target"), [(4, 8), (8, 3), (16, 8), (23, 5)])
def test_a_unit_asks_the_units_scheduled_before_it_in_its_row_and_column_to_lead(count: int, target: int) -> None:
    """Its row's leaders are the units at earlier places of its row, earliest first, each as many spacings earlier as
    its place is; its column's are the units of its column in earlier rows, as many spacings earlier as their row."""
    cells = layout(count, target)
    for cell in cells.values():
        row_mates = sorted((c.place, p) for p, c in cells.items() if c.row == cell.row and c.place < cell.place)
        assert [leader.peer_id for leader in cell.row_leaders] == [p for _, p in row_mates]
        assert all(leader.offset_s == pytest.approx((cells[leader.peer_id].place - cell.place) * SPACING_S)
                   for leader in cell.row_leaders)  # fmt: skip
        column_mates = {
            p for p, c in cells.items() if c.columns and c.column_bits == cell.column_bits and c.row < cell.row
        }
        assert {leader.peer_id for leader in cell.column_leaders} == column_mates
        assert [cells[leader.peer_id].row for leader in cell.column_leaders] == sorted(
            cells[p].row for p in column_mates
        )
        assert all(leader.offset_s == pytest.approx((cells[leader.peer_id].row - cell.row) * SPACING_S)
                   for leader in cell.column_leaders)  # fmt: skip
    leaders = [cell for cell in cells.values() if cell.place == 0]
    assert all(not cell.row_leaders for cell in leaders) and len(leaders) == leaders[0].rows


def test_each_unit_sees_the_same_row_and_column_members_as_the_units_placed_there() -> None:
    census = [f"unit-{index}" for index in range(11)]
    for salt in ("0@1.000", "0@2.000", "1@2.000"):
        cells = {peer: grid_cell(census, peer, salt, target=4) for peer in census}
        for peer, cell in cells.items():
            assert peer in cell.row_members and peer in cell.column_members
            assert set(cell.row_members) == {other for other in census if cells[other].row == cell.row}
            assert set(cell.column_members) == {other for other in census if cells[other].column == cell.column}


@pytest.mark.parametrize("colluders, together", [(2, 3 / 15), (3, 3 / 15 * 2 / 14)])
def test_colluding_identities_share_a_row_no_more_often_than_chance(colluders: int, together: float) -> None:
    """16 units in rows of 4, drawn anew each round from (round, peer id): 2 colluders share a row in 3/15 of the
    rounds (never a majority of its 4), 3 in 3/15 × 2/14 (a majority: 2.9% of the rounds), as for a uniform draw."""
    census = [f"unit-{index}" for index in range(16)]
    rounds = 4000
    shared = 0
    for boundary in range(rounds):
        rows = {grid_cell(census, peer, f"0@{boundary}.000", target=4).row for peer in census[:colluders]}
        shared += len(rows) == 1
    spread = 4 * (together * (1 - together) / rounds) ** 0.5  # four standard deviations of the binomial frequency
    assert abs(shared / rounds - together) < spread, (shared / rounds, together)
