"""Red team: a modified unit (tests/red_team.py) joins a swarm of honest units (real processes on 127.0.0.1), and
the honest units hold."""

from __future__ import annotations

from pathlib import Path

import pytest
from red_team import red_team_cli
from swarms import close_leaving_nothing, quick_swarm

from p2p_diloco.events import Eval, LocalReset, OuterRoundFailed
from p2p_diloco.members import MAX_ROUND_LEAD

pytestmark = pytest.mark.swarm

HONEST = ("a", "b")
ROUNDS_WITH_THE_RED_UNIT = 3
REJECTED_ROUNDS = 2
EXIT_GRACE_S = 90.0  # a unit's exit may take its final rounds and settle rounds (up to 33 s each for quick units)


@pytest.mark.parametrize("variant", ["gather-garbage", "gather-far-ahead"])
def test_round_metadata_out_of_range_is_not_believed(tmp_path: Path, variant: str) -> None:
    """Without validation, an infinite round number made every honest unit exit 1 (OverflowError in its poll), and
    a claimed round of 10^6 made their counters jump to it."""
    swarm = quick_swarm(tmp_path)
    try:
        maddr = swarm.bootstrap("bootstrap")
        for name in HONEST:
            swarm.unit(name, [maddr])
        swarm.unit("red", [maddr], cli=red_team_cli(variant))

        def met_the_red_unit() -> bool:
            return all(sum(r.group_size == 3 for r in swarm.rounds(n)) >= ROUNDS_WITH_THE_RED_UNIT for n in HONEST)

        swarm.wait_for(met_the_red_unit, timeout_s=180, what=f"{ROUNDS_WITH_THE_RED_UNIT} rounds with the red unit")
        assert all(swarm.running(name) for name in HONEST), swarm.tails()
        for name in HONEST:
            rounds = swarm.rounds(name)
            assert rounds[-1].outer_round <= len(rounds) * (MAX_ROUND_LEAD + 1), (name, rounds[-1])
            assert "not believed" in (tmp_path / name / "stdout.log").read_text(), swarm.tail(name)
        assert swarm.stop(list(HONEST), grace_s=EXIT_GRACE_S) == [0, 0], swarm.tails()
    finally:
        close_leaving_nothing(swarm)


def test_an_average_far_out_of_scale_is_not_merged(tmp_path: Path) -> None:
    """Without the bound, a member sending 1000 × its proposal took the honest units' φ to a loss of 10^6 (they reset
    θ over and over and exported it). (A member adding N(0, 1) noise moved φ of the tiny model less than 10 × as far as
    an honest step in some rounds: they pass the bound; that needs a bound per member.)"""
    variant = "payload-x1000"
    swarm = quick_swarm(tmp_path)
    try:
        maddr = swarm.bootstrap("bootstrap")
        for name in HONEST:
            swarm.unit(name, [maddr], "--eval-every-rounds", "1")
        swarm.unit("red", [maddr], cli=red_team_cli(variant))

        def rejected(name: str) -> int:
            return sum(event.status == "rejected" for event in swarm.events(name, OuterRoundFailed))

        swarm.wait_for(lambda: all(rejected(n) >= REJECTED_ROUNDS for n in HONEST), timeout_s=180,
                       what=f"{REJECTED_ROUNDS} rejected rounds")  # fmt: skip
        assert swarm.stop(list(HONEST), grace_s=EXIT_GRACE_S) == [0, 0], swarm.tails()
        for name in HONEST:
            losses = [event.eval_loss for event in swarm.events(name, Eval)]
            assert all(loss is not None and loss <= losses[0] for loss in losses), (name, losses)
            assert not swarm.events(name, LocalReset), name
            assert "moves φ" in (tmp_path / name / "stdout.log").read_text(), swarm.tail(name)
    finally:
        close_leaving_nothing(swarm)
