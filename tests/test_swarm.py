"""Swarm tests: real hivemind peers as separate processes on 127.0.0.1 (see bench/swarm.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from swarms import close_leaving_nothing, quick_swarm

from bench.swarm import Swarm
from p2p_diloco.lifecycle import is_running
from p2p_diloco.unit.events import Eval, Join, OuterRound, StateDownload

pytestmark = pytest.mark.swarm

# After a round in which the whole group averaged, members hold the same all-reduce output; the probe
# drift (relative distance of the members' global parameters before a round) is then float round-off.
HEALED_DRIFT_BOUND = 1e-5
# A genuinely split swarm drifts far more than that within a couple of rounds.
SPLIT_DRIFT_FLOOR = 1e-3


@pytest.fixture
def swarm(tmp_path: Path):
    swarm = quick_swarm(tmp_path)
    yield swarm
    close_leaving_nothing(swarm)


def test_demo_trains_three_peers_in_groups(tmp_path: Path) -> None:
    """The README's main command: eval loss of the consensus model falls and groups of several peers form."""
    result = subprocess.run(
        [sys.executable, "-m", "p2p_diloco.cli", "demo", "--duration", "25", "--work-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
    )
    logs = "".join(f"\n--- {log}:\n" + "\n".join(log.read_text().splitlines()[-40:])
                   for log in sorted(tmp_path.glob("run-*/peer*/stdout.log")))  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr + logs  # the units' logs say why groups did not form
    assert "demo succeeded" in result.stdout
    assert "merged in a group of" in result.stdout and "peer0  eval loss" in result.stdout, "the rounds as they end"
    assert "Exception" not in result.stdout + result.stderr
    (run_dir,) = tmp_path.glob("run-*")
    assert (run_dir / "summary.md").exists()
    for index in range(3):
        assert (run_dir / f"peer{index}" / "model" / "model.safetensors").exists()


def test_sigkilled_unit_leaves_no_process_behind(swarm: Swarm) -> None:
    """SIGKILL of a unit's main process only: its watchdog, DHT, both averagers and their p2pd exit by themselves.
    (What the other units do meanwhile is tested in test_chaos_swarm.py.)"""
    maddr = swarm.bootstrap("bootstrap")
    swarm.unit("victim", [maddr])
    swarm.wait_for(lambda: swarm.events("victim", Join), timeout_s=90, what="the unit to join")
    children = swarm.kill_main_process("victim")
    assert len(children) >= 5, children  # watchdog, DHT, 2 averagers, their p2pd
    swarm.wait_for(
        lambda: not any(is_running(pid) for pid in children),
        timeout_s=15,
        what="the killed unit's DHT, averagers and p2pd to exit",
    )


def assert_joined_from_swarm(swarm: Swarm, name: str, donors: tuple[str, ...], after: float = 0.0) -> None:
    """``name`` downloaded the swarm's state: its first eval of φ equals a donor's eval at the same round."""
    join = swarm.wait_for(lambda: swarm.events(name, Join, after), timeout_s=90, what=f"{name} to join")[0]
    assert join.source == "swarm" and join.outer_round >= 3, join
    assert swarm.events(name, StateDownload, after)
    first_eval = swarm.wait_for(lambda: swarm.events(name, Eval, after), timeout_s=30, what=f"{name}'s eval")[0]

    def donor_evals() -> list[float]:  # a donor's eval after a round is spread over its next inner steps
        return [event.eval_loss for donor in donors for event in swarm.events(donor, Eval)
                if event.outer_round == first_eval.outer_round and event.eval_loss is not None]  # fmt: skip

    swarm.wait_for(donor_evals, timeout_s=60, what=f"a donor's eval of outer round {first_eval.outer_round}")
    # Same held-out batches and same global parameters give the same loss: the download is the swarm's φ.
    tolerance = 1e-6 * first_eval.eval_loss
    assert min(abs(loss - first_eval.eval_loss) for loss in donor_evals()) <= tolerance


def test_late_joiners_download_the_swarm_state_even_from_units_busy_longer_than_their_records_live(
    swarm: Swarm,
) -> None:
    """A late joiner downloads the state of a swarm past round 3. Then (issue 36: a SmolLM2 unit joined while the others
    were busy in long evaluations, their progress records 24 to 34 s old, and trained from the initial weights) the
    units' main processes stop (SIGSTOP; their forked DHT processes go on) until no progress record of the run is left:
    a second joiner waits, takes the round their donor records declare, and downloads the state once the units go on
    (a state server answers through its unit's main process, which SIGSTOP stops entirely)."""
    maddr = swarm.bootstrap("bootstrap")
    for name in ("a", "b"):
        swarm.unit(name, [maddr])
    swarm.wait_for(lambda: all(len(swarm.rounds(n)) >= 3 for n in ("a", "b")), timeout_s=150, what="3 rounds")
    swarm.unit("late", [maddr])
    assert_joined_from_swarm(swarm, "late", donors=("a", "b"))
    swarm.wait_for(
        lambda: any(r.group_size == 3 for r in swarm.rounds("late")), timeout_s=90, what="a round with all three"
    )
    status = run_status(maddr, swarm.run_id)
    assert status.returncode == 0, status.stderr
    peer_ids = {swarm.events(name, Join)[0].peer_id for name in ("a", "b", "late")}
    assert all(peer_id in status.stdout for peer_id in peer_ids), status.stdout

    busy = ("a", "b", "late")
    for name in busy:  # busy: the main process stops, its children do not
        pid = swarm.processes[name].pid
        os.kill(pid, signal.SIGSTOP)
        swarm.frozen[name], swarm.faulted_pids = [pid], swarm.faulted_pids | {pid}

    def no_progress_left() -> bool:
        status = run_status(maddr, swarm.run_id)
        return status.returncode == 1 and "has reported progress" in status.stderr

    swarm.wait_for(no_progress_left, timeout_s=90, what="the busy units' progress records to expire")
    swarm.unit("later", [maddr])
    console = swarm.root / "later" / "stdout.log"
    swarm.wait_for(lambda: "donors declare outer round" in console.read_text(), timeout_s=90,
                   what="later to take the donors' word for the swarm's round")  # fmt: skip
    for name in busy:  # the busy spell ends
        swarm.thaw(name)
    assert_joined_from_swarm(swarm, "later", donors=busy)


def run_status(maddr: str, run_id: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "p2p_diloco.cli", "status", "--initial-peers", maddr, "--run-id", run_id]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_split_swarm_comes_back_into_consensus(swarm: Swarm) -> None:
    """Two halves train apart (two DHT islands), then a node that knows both heals the split."""
    left, right = swarm.bootstrap("bootstrap-left"), swarm.bootstrap("bootstrap-right")
    halves = {"l0": left, "l1": left, "r0": right, "r1": right}
    for name, maddr in halves.items():
        swarm.unit(name, [maddr])
    swarm.wait_for(
        lambda: all(sum(r.group_size == 2 for r in swarm.rounds(n)) >= 2 for n in halves),
        timeout_s=180,
        what="both halves to average apart for two rounds",
    )
    assert all(max(r.group_size for r in swarm.rounds(n)) == 2 for n in halves), "the halves were not split"
    healed_at = time.time()
    swarm.bootstrap("bridge", initial_peers=(left, right))

    def healed_round() -> OuterRound | None:
        candidates = [r for n in halves for r in swarm.rounds(n, after=healed_at) if r.group_size == 4]
        return next((r for r in candidates if r.member_drift < HEALED_DRIFT_BOUND), None)

    what = f"a round of all four peers with drift < {HEALED_DRIFT_BOUND}"
    healed = swarm.wait_for(healed_round, timeout_s=180, what=what)
    merged = [r for n in halves for r in swarm.rounds(n, after=healed_at) if r.group_size > 2]
    split_drift = max(r.member_drift for r in merged)
    print(f"drift when the halves met: {split_drift:.3g}; after healing: {healed.member_drift:.3g}")
    assert split_drift > SPLIT_DRIFT_FLOOR, "the halves had not drifted apart"
