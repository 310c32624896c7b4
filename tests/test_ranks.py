"""Learning units of two gloo ranks each (torch's elastic launcher through ``--nproc-per-node 2``), real processes on
127.0.0.1: rounds between the units, identical θ on a unit's ranks, token weights of all ranks, and a rank SIGKILLed
(the launcher restarts its unit, which rejoins from the swarm while the other unit trains on), and the launcher
SIGKILLed (its ranks go with it)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from swarms import QUICK_UNIT_FLAGS, close_leaving_nothing, quick_swarm

from bench.swarm import Swarm
from p2p_diloco.events import Eval, Join, OuterRound, OuterRoundBegin, ReplicaProbe, read_events
from p2p_diloco.lifecycle import descendant_pids, is_running

pytestmark = pytest.mark.swarm

RANKS = ("--nproc-per-node", "2", "--threads", "1", "--max-restarts", "2")
TOKENS_PER_RANK_STEP = 4 * 64  # QUICK_UNIT_FLAGS: 4 sequences of 64 tokens
INNER_STEPS = int(QUICK_UNIT_FLAGS[QUICK_UNIT_FLAGS.index("--inner-steps") + 1])


@pytest.fixture
def swarm(tmp_path: Path):
    swarm = quick_swarm(tmp_path)
    yield swarm
    close_leaving_nothing(swarm)


def replica_probes(swarm: Swarm, name: str, rank: int, after: float = 0.0) -> dict[int, list[float]]:
    """θ probes of rank ``rank`` of unit ``name`` by the unit's inner step (written after rank 0 shared a θ)."""
    log = swarm.root / name / ("metrics.jsonl" if rank == 0 else f"rank{rank}.jsonl")
    probes = read_events(log, ReplicaProbe)
    return {probe.inner_step: probe.values for probe in probes if probe.rank == rank and probe.time > after}


def merged_with_other(swarm: Swarm, name: str, after: float = 0.0) -> list[OuterRound]:
    return [event for event in swarm.rounds(name, after) if event.status == "merged" and event.group_size == 2]


def rank_pid(swarm: Swarm, name: str, rank: int) -> int:
    """The pid of rank ``rank`` of unit ``name`` (a worker of the unit's launcher)."""
    for pid in descendant_pids(swarm.processes[name].pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"p2p_diloco.cli" in command:
            return pid
    raise AssertionError(f"no rank {rank} of {name} among {descendant_pids(swarm.processes[name].pid)}")


def test_units_of_two_ranks_average_and_a_killed_rank_restarts_its_unit(swarm: Swarm) -> None:
    maddr = swarm.bootstrap("bootstrap")
    for name in ("a", "b"):
        swarm.unit(name, [maddr], *RANKS)
    swarm.wait_for(lambda: all(len(merged_with_other(swarm, n)) >= 3 for n in ("a", "b")), timeout_s=240,
                   what="3 rounds merged between the two units")  # fmt: skip

    for name in ("a", "b"):
        (join,) = swarm.events(name, Join)
        assert join.ranks == 2, join
        lead, follower = replica_probes(swarm, name, 0), replica_probes(swarm, name, 1)
        shared = sorted(set(lead) & set(follower))
        assert len(shared) >= 4, (sorted(lead), sorted(follower))  # the start and after each merge
        assert all(lead[step] == follower[step] for step in shared), name
        # a round's weight is the tokens of both ranks since the unit's previous round began
        steps = [0] + [event.inner_step for event in swarm.events(name, OuterRoundBegin)]
        weights = [event.weight for event in swarm.events(name, OuterRoundBegin)]
        assert weights == [(now - before) * TOKENS_PER_RANK_STEP * 2 for before, now in zip(steps, steps[1:])]
        assert steps[1] == INNER_STEPS
        evals = [event.eval_loss for event in swarm.events(name, Eval) if event.eval_loss is not None]
        assert evals[-1] < evals[0] - 0.5, evals

    killed_at = time.time()
    os.kill(rank_pid(swarm, "b", 1), signal.SIGKILL)
    rejoin = swarm.wait_for(lambda: swarm.events("b", Join, killed_at), timeout_s=120,
                            what="b restarted by the launcher and joined again")[0]  # fmt: skip
    assert rejoin.source == "swarm" and rejoin.ranks == 2, rejoin
    assert swarm.running("a"), swarm.tail("a")
    assert [event for event in swarm.rounds("a", killed_at) if event.time < rejoin.time], (
        "a completed no round while b was restarting"
    )
    swarm.wait_for(lambda: merged_with_other(swarm, "a", rejoin.time), timeout_s=120,
                   what="a round of a with the restarted b")  # fmt: skip
    lead, follower = replica_probes(swarm, "b", 0, killed_at), replica_probes(swarm, "b", 1, killed_at)
    shared = set(lead) & set(follower)
    assert shared and all(lead[step] == follower[step] for step in shared)  # the restarted ranks share θ again

    # SIGKILL of the launcher alone (the unit's top process): its ranks and their hivemind processes go with it
    tree = swarm.kill_main_process("b")
    assert len(tree) >= 7, tree  # two ranks; rank 0's watchdog, DHT, averagers, state server and p2pd
    swarm.wait_for(lambda: not any(is_running(pid) for pid in tree), timeout_s=15,
                   what="b's ranks and their processes to exit after their launcher")  # fmt: skip
