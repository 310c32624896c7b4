"""One model from a swarm whose groups cannot hold everyone: 6 units with target group size 2 on 127.0.0.1 train on
the default (clock) schedule, one model at most moments while they train (rows of two, then columns of three, the
rows' merges held until the columns': rounds/grid.py), then leave together, one of them held up at exit (its main
process stopped, once it announced that it finishes, for longer than the others' --settle-rounds take): the others'
final round, all of them in one group, misses it, and their settle rounds at exit must make them leave as one
model. (Freezing its whole process tree instead once timed torch's shared memory manager out: unit.py's settle
averager start.)

Tolerance (DESIGN.md's consensus measure and the swarm benchmark's target): every pair of φ probes within a relative
distance of 1e-3 at ONE_MODEL_SHARE of the seconds of six rounds after the swarm's start (each second, every unit's
latest probe; the start ends when every unit's round began on a layout of all six and on one period), every pair of
final checkpoints within 1e-3, and the units' final eval losses within 0.5% of their mean."""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from swarms import close_leaving_nothing, quick_swarm

from bench.scale import timeline
from bench.swarm import Swarm
from p2p_diloco.checkpoint import load_checkpoint
from p2p_diloco.unit.events import ConsensusRound, Eval, ModelProbe, OuterRoundBegin, Stop

pytestmark = pytest.mark.swarm
UNITS = 6
ONE_MODEL_SHARE = 0.6
"""Of the seconds after the warm-up (every unit's latest probe each second). Measured alone on this machine: 94% of
33 s (one model but for two 1-s blips, where one column's mix round ended a second before the other's). With columns
capped at two units (hivemind's group size fixed at the target) 0 to 10%; with columns of three but each row's merge
applied at once, 45% (the rows held three means for half of each period); on the steps schedule the swarm
benchmark's 6 units in groups of 2 held one model 4% of the time (results/scale/n6-g2). So 60% passes only with
every period's rows and columns met, on a machine that runs another test beside this one. Two such runs side by side
(measured from every unit's third round, four rounds): 72% and 63%, and 58% once in CI. What they lost: the start,
when units had joined seconds apart and still drew layouts from 1 to 5 units on periods of 4, 8 and 16 s (21 of 63
seconds, [2, 2, 1, 1] then [3, 1, 1, 1]), now left out by the window's start; and an all-reduce that ended with a
member's averaged part missing under load ("returned 1 of 2 averaged parts"), which left one unit 7e-2 apart for a
period (8 of 32 s, [5, 1]) until its next round merged it, now one period in six. Two runs side by side as this test
is now: 85% of 84 s and 82% of 82 s (the first period on the whole layout, 9-10 s of [3, 2, 1], then 1-s blips);
then 60% of 42 s once in CI (periods of 7 s: 14 s of [2, 2, 2] and [3, 2, 1] in the first two periods on the whole
layout, then one model but for three 1-s blips), so the window now starts once every unit merged a round after the
whole layout was reached."""
HELD_UP_S = 25.0  # the held-up unit's stop at exit: longer than the others' 4 settle rounds (a 4 s grid) take


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[Swarm]:
    swarm = quick_swarm(tmp_path, "--target-group-size", "2")
    try:
        yield swarm
    finally:
        close_leaving_nothing(swarm)


def _phi(unit_dir: Path) -> torch.Tensor:
    checkpoint = load_checkpoint(unit_dir / "checkpoint.pt")
    assert checkpoint is not None, f"{unit_dir} wrote no checkpoint"
    return torch.cat([tensor.reshape(-1).double() for tensor in checkpoint["global_params"]])


def _settled(swarm: Swarm, names: list[str]) -> bool:
    """Whether every unit's latest round began on a layout of all the units and on the period the others' did: the
    swarm's start is over (units joined seconds apart, and their periods grow to the slowest unit's over rounds)."""
    latest = [swarm.events(name, OuterRoundBegin)[-1:] for name in names]
    return (
        all(begun and begun[0].census_units == UNITS for begun in latest) and len({b[0].period_s for b in latest}) == 1
    )


def _exits(swarm: Swarm, names: list[str]) -> dict[str, object]:
    """What each unit's exit went through, for a failure's message: its settle rounds (group size, applied, drift)
    and the warnings it logged about members."""
    said: dict[str, object] = {}
    for name in names:
        settles = [(c.group_size, c.applied, f"{c.member_drift:.1e}") for c in swarm.events(name, ConsensusRound)
                   if c.kind == "settle"]  # fmt: skip
        log = (swarm.root / name / "stdout.log").read_text().splitlines()
        said[name] = (settles, [line[-160:] for line in log if "offended" in line or "refused" in line][-3:])
    return said


@pytest.mark.timeout(480)
def test_units_in_groups_of_two_leave_as_one_model(swarm: Swarm) -> None:
    maddr = swarm.bootstrap("bootstrap")
    names = [f"unit{index}" for index in range(UNITS)]
    for name in names:
        swarm.unit(name, [maddr])
    swarm.wait_for(lambda: _settled(swarm, names), 240, "every unit's round on the whole census and one period")
    settled = time.time()  # the first period on the whole layout still mixes its rows' means: one round more
    swarm.wait_for(lambda: all(swarm.rounds(name, settled) for name in names), 60, "a round each on the whole layout")
    warm = time.time()
    swarm.wait_for(lambda: all(len(swarm.rounds(name, warm)) >= 6 for name in names), 300, "six more rounds each")
    assert max(r.group_size for name in names for r in swarm.rounds(name)) <= 2
    points = timeline({name: swarm.events(name, ModelProbe) for name in names}, warm, time.time())
    share = sum(point["max"] <= 1e-3 for point in points) / len(points)
    assert share >= ONE_MODEL_SHARE, f"one model {share:.0%} of {len(points)} s: {[p['clusters'] for p in points]}"
    held_up, stopped = names[-1], time.time()
    with ThreadPoolExecutor(1) as stopping:
        codes = stopping.submit(swarm.stop, names, grace_s=180)
        log = swarm.root / held_up / "stdout.log"
        swarm.wait_for(lambda: "finishing the last outer rounds" in log.read_text(), 60, f"{held_up} finishing")
        main_process = swarm.processes[held_up].pid
        os.kill(main_process, signal.SIGSTOP)
        try:
            time.sleep(HELD_UP_S)  # the fault's length, not a wait for a condition
        finally:
            os.kill(main_process, signal.SIGCONT)
        assert codes.result() == [0] * UNITS
    settled = [c.group_size for name in names for c in swarm.events(name, ConsensusRound) if c.kind == "settle"
               and c.applied]  # fmt: skip
    final = [r.group_size for name in names for r in swarm.rounds(name, stopped)]
    assert max(settled + final) > 2, "the final or settle rounds met in groups beyond the target"
    phis = [_phi(swarm.root / name) for name in names]
    distances = [float((a - b).norm() / max(a.norm(), b.norm())) for a, b in itertools.combinations(phis, 2)]
    assert max(distances) <= 1e-3, f"pairwise φ distances at exit: {distances}; {_exits(swarm, names)}"
    assert all(swarm.events(name, Stop) for name in names)
    finals = [swarm.events(name, Eval)[-1] for name in names]
    losses = [final.eval_loss for final in finals if final.reason == "final" and final.eval_loss is not None]
    assert len(losses) == UNITS and (max(losses) - min(losses)) / (sum(losses) / UNITS) <= 5e-3, losses
