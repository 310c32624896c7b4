"""Red team: a modified unit (bench/red_team.py) joins a swarm of honest units (real processes on 127.0.0.1), and
the honest units hold."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from swarms import close_leaving_nothing, quick_swarm
from test_swarm import assert_joined_from_swarm

from bench.red_team import FORGED_ROUND, admitted_flags, red_team_cli
from p2p_diloco.network.dht import ensure_identity
from p2p_diloco.trust import MAX_ROUND_LEAD
from p2p_diloco.unit.events import Eval, InnerStep, Join, LocalReset

pytestmark = pytest.mark.swarm

HONEST = ("a", "b")
ROUNDS_WITH_THE_RED_UNIT = 3
EXIT_GRACE_S = 90.0  # a unit's exit may take its final rounds and settle rounds (up to 13 s each for quick units)


def test_round_metadata_out_of_range_is_not_believed(tmp_path: Path) -> None:
    """Two red members in one swarm, one gathering garbage (an infinite round number, a NaN weight, a tag that is no
    string), one a round of 10^6. Without validation the infinite round made every honest unit exit 1 (OverflowError
    in its poll), and the claimed round made their counters jump to it. Each honest unit names both red members'
    metadata as not believed, keeps running and keeps its own round count."""
    swarm = quick_swarm(tmp_path)
    reds = {"red-garbage": "gather-garbage", "red-far": "gather-far-ahead"}
    try:
        maddr = swarm.bootstrap("bootstrap")
        for name in HONEST:
            swarm.unit(name, [maddr])
        for name, variant in reds.items():
            swarm.unit(name, [maddr], cli=red_team_cli(variant))
        red_ids = [swarm.wait_for(lambda n=name: peer_id_in_log(tmp_path / n), timeout_s=60, what=f"{name}'s peer id")
                   for name in reds]  # fmt: skip

        def disbelieved(name: str) -> bool:
            lines = [
                line for line in (tmp_path / name / "stdout.log").read_text().splitlines() if "not believed" in line
            ]
            return all(any(f"member {red_id}" in line for line in lines) for red_id in red_ids)

        def met_the_red_units() -> bool:
            merged = all(sum(r.group_size >= 3 for r in swarm.rounds(n)) >= ROUNDS_WITH_THE_RED_UNIT for n in HONEST)
            return merged and all(disbelieved(name) for name in HONEST)

        swarm.wait_for(met_the_red_units, timeout_s=180, what=f"{ROUNDS_WITH_THE_RED_UNIT} rounds with the red units")
        assert all(swarm.running(name) for name in HONEST), swarm.tails()
        for name in HONEST:
            rounds = swarm.rounds(name)
            assert rounds[-1].outer_round <= len(rounds) * (MAX_ROUND_LEAD + 1), (name, rounds[-1])
        assert swarm.stop(list(HONEST), grace_s=EXIT_GRACE_S) == [0, 0], swarm.tails()
    finally:
        close_leaving_nothing(swarm)


# The clip bounds one member among three or more (trust.py CLIP_FACTOR): in a pair no rule tells who is honest, and a
# flipped ×3 partner takes an honest unit one step back (seen in CI: eval 7.58 -> 8.60 after a round with the red unit
# alone), which the next issue's direction-aware judging is for. The honest units take no average of fewer than three
# there; every other variant is refused in pairs too.
IN_GROUPS_OF_THREE = ("--quorum", "3")


@pytest.mark.parametrize(
    "variant, defences, honest_flags",
    [
        ("payload-nan", ("offended",), ()),
        ("payload-x1000", ("offended",), ()),
        ("payload-noise+weight-x1000", (r"[1-9]\d* of \d+ parts dropped", r"[1-9]\d* weights capped"), ()),
        ("step-flip", ("pull against",), IN_GROUPS_OF_THREE),
        ("reducer-x1000", ("averages replaced",), ()),
    ],
)
def test_one_member_cannot_move_the_honest_units_far(
    tmp_path: Path, variant: str, defences: tuple[str, ...], honest_flags: tuple[str, ...]
) -> None:
    """Without bounds, a member sending 1000 × its proposal took the honest units' φ to a loss of 10^6 (they reset
    θ over and over and exported it), one adding N(0, 1) noise to 16.7, a sign-flipped ×3 step to +9%, a member
    claiming 1000 × its tokens owned every average, and a reducer returning 1000 × its slice's average moved
    everyone's φ there; a step flipped at honest length stays inside every bound on size (issue 37: +4.8% with 1 of 4
    such members, never refused). Each honest unit reduces its slice with the bounded mean (robust.py), checks the
    averages others return (reducer.py) and compares the members' steps with its own over rounds (gated.py): it logs
    the red member's part as clipped, capped or dropped, its averages as replaced, or its steps as pulling against
    its own (a noisy member claiming 1000 × its tokens: its parts dropped and its weight capped), and its loss keeps
    going down (its evals of every round; the units are closed, not stopped: their exit
    under attack is asserted by the other tests here and measured in every variant of the security benchmark)."""
    swarm = quick_swarm(tmp_path)
    try:
        maddr = swarm.bootstrap("bootstrap")
        for name in HONEST:
            swarm.unit(name, [maddr], "--eval-every-rounds", "1", *honest_flags)
        swarm.unit("red", [maddr], cli=red_team_cli(*variant.split("+")))
        red_id = swarm.wait_for(lambda: peer_id_in_log(tmp_path / "red"), timeout_s=60, what="the red unit's peer id")

        def judged(name: str) -> bool:
            lines = [line for line in (tmp_path / name / "stdout.log").read_text().splitlines()
                     if f"member {red_id}" in line]  # fmt: skip
            return all(any(re.search(defence, line) for line in lines) for defence in defences)

        def held() -> bool:  # a red member refused early meets the honest units in fewer rounds: count merged ones
            merged = all(sum(r.group_size >= 2 for r in swarm.rounds(n)) >= ROUNDS_WITH_THE_RED_UNIT for n in HONEST)
            return merged and all(judged(name) for name in HONEST)

        swarm.wait_for(held, timeout_s=180, what=f"{ROUNDS_WITH_THE_RED_UNIT} merged rounds, the red unit judged")
        assert all(swarm.running(name) for name in HONEST), (
            swarm.tails()
        )  # clean exits: the benchmark and the tests below
        for name in HONEST:
            losses = [event.eval_loss for event in swarm.events(name, Eval)]
            assert all(loss is not None for loss in losses) and losses[-1] < losses[0], (name, losses)
            assert not swarm.events(name, LocalReset), name
    finally:
        close_leaving_nothing(swarm)


def test_a_joiner_takes_neither_a_poisoned_state_nor_a_flood_of_donors_nor_forged_records(tmp_path: Path) -> None:
    """One red unit serves random tensors declared at round 10^6, declares SYBIL_DONORS other identities donors of a
    fresher state that none serves, and publishes its progress under another peer's id at round FORGED_ROUND.
    Without the defences a joiner downloaded the garbage (eval 73.5 while the swarm was at 6.2) and jumped the swarm's
    rounds to 10^6, a donor flood kept every joiner out (exit 2), and ``status`` showed the forged round. Now a late
    honest unit joins from the honest donors' corroborated state (its first eval is theirs), nobody's round jumps,
    and no one reads the forged record."""
    swarm = quick_swarm(tmp_path)
    try:
        maddr = swarm.bootstrap("bootstrap")
        for name in HONEST:
            swarm.unit(name, [maddr])
        swarm.wait_for(lambda: all(len(swarm.events(n, InnerStep)) >= 2 for n in HONEST), timeout_s=90,
                       what="the honest units training (progress records out, for the red unit to forge)")  # fmt: skip
        swarm.unit("red", [maddr], cli=red_team_cli("state-far-ahead", "donor-flood", "record-forgery"))
        swarm.wait_for(lambda: all(len(swarm.rounds(n)) >= 3 for n in HONEST) and swarm.rounds("red"), timeout_s=180,
                       what="3 rounds of the honest units, one of the red unit (its records are out)")  # fmt: skip
        swarm.unit("late", [maddr])
        assert_joined_from_swarm(swarm, "late", donors=HONEST)
        late_log = (tmp_path / "late" / "stdout.log").read_text()
        assert "not believed" in late_log and "corroborated by" in late_log, swarm.tail("late", 60)
        swarm.wait_for(lambda: len(swarm.rounds("late")) >= 2, timeout_s=90, what="2 rounds of the late unit")
        for name in (*HONEST, "late"):
            rounds = swarm.rounds(name)
            assert rounds[-1].outer_round <= len(rounds) * (MAX_ROUND_LEAD + 1) + 10, (name, rounds[-1])
        assert swarm.stop([*HONEST, "late"], grace_s=EXIT_GRACE_S) == [0, 0, 0], swarm.tails()
        status = subprocess.run(  # the red unit still forges; its victims' records outlive them
            [sys.executable, "-m", "p2p_diloco.cli", "status", "--initial-peers", maddr, "--run-id", swarm.run_id],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert status.returncode == 0 and str(FORGED_ROUND) not in status.stdout, status.stdout + status.stderr
        assert all(str(peer_id_in_log(tmp_path / name)) in status.stdout for name in HONEST), status.stdout
        assert swarm.running("red"), swarm.tail("red")
    finally:
        close_leaving_nothing(swarm)


def test_a_joiner_refuses_the_forged_state_two_colluding_donors_agree_on(tmp_path: Path) -> None:
    """Issue 37: two red units serve the same forged state (φ plus noise drawn from the round) two rounds ahead of
    theirs, so each download corroborates the other; a joiner took it (eval 73.5 while the swarm stood at 6.2). Now it
    evaluates what it downloaded, refuses a loss over STATE_LOSS_RATIO × the honest units' reported eval losses, and
    takes the honest donors' state."""
    swarm = quick_swarm(tmp_path)
    try:
        maddr = swarm.bootstrap("bootstrap")
        for name in HONEST:
            swarm.unit(name, [maddr])
        swarm.wait_for(lambda: all(swarm.events(n, Join) for n in HONEST), timeout_s=90, what="the honest units' joins")
        for name in ("red1", "red2"):
            swarm.unit(name, [maddr], cli=red_team_cli("state-forged-together"))
        units = (*HONEST, "red1", "red2")
        swarm.wait_for(lambda: all(len(swarm.rounds(n)) >= 3 for n in units) and all(
            swarm.events(n, Eval, 0.0)[1:] for n in HONEST), timeout_s=180,
            what="3 rounds of every unit and an eval of the honest ones after a round")  # fmt: skip
        swarm.unit("late", [maddr])
        assert_joined_from_swarm(swarm, "late", donors=HONEST)
        late_log = (tmp_path / "late" / "stdout.log").read_text()
        assert "refused: its held-out loss" in late_log, swarm.tail("late", 60)
    finally:
        close_leaving_nothing(swarm)


def peer_id_in_log(work_dir: Path) -> str | None:
    """The peer id a unit logged when its DHT started, once it did."""
    log = work_dir / "stdout.log"
    for line in log.read_text().splitlines() if log.exists() else []:
        if "dht started peer_id=" in line:
            return line.split("peer_id=")[1].split()[0]
    return None


def test_a_non_member_of_a_private_run_gets_no_tensor_in_and_no_state_out(tmp_path: Path) -> None:
    """An unmodified unit that knows the run id and the bootstrap address, started with the members: it trains alone
    (its join requests, leads and groups are refused); one that starts later, once the first one left, cannot
    download the state (exit 2). Without membership such a unit averaged with the members and downloaded the trained
    state in 0.1 s."""
    swarm = quick_swarm(tmp_path)
    run_key = ensure_identity(tmp_path / "run.key")
    try:
        maddr = swarm.bootstrap("bootstrap")
        for name in HONEST:
            swarm.unit(name, [maddr], *admitted_flags(tmp_path, name, swarm.run_id, run_key))
        swarm.unit("red", [maddr])

        def rounds_done() -> bool:
            merged = [sum(r.group_size == 2 for r in swarm.rounds(n)) >= ROUNDS_WITH_THE_RED_UNIT for n in HONEST]
            return all(merged) and len(swarm.rounds("red")) >= ROUNDS_WITH_THE_RED_UNIT

        swarm.wait_for(rounds_done, timeout_s=180, what=f"{ROUNDS_WITH_THE_RED_UNIT} rounds of every unit")
        assert all(r.group_size == 1 for r in swarm.rounds("red")), swarm.tail("red")
        assert swarm.stop(["red"], grace_s=EXIT_GRACE_S) == [0], swarm.tail("red")  # it would serve its own state
        late = swarm.unit("late", [maddr], "--join-timeout-s", "15")
        assert late.wait(timeout=120) == 2, swarm.tail("late")
        assert "no live peer served its state" in (tmp_path / "late" / "stdout.log").read_text(), swarm.tail("late")
        assert swarm.stop(list(HONEST), grace_s=EXIT_GRACE_S) == [0, 0], swarm.tails()
        for name in HONEST:
            assert all(r.group_size <= 2 for r in swarm.rounds(name)), name
            assert "not a member of the run" in (tmp_path / name / "stdout.log").read_text(), swarm.tail(name)
    finally:
        close_leaving_nothing(swarm)
