"""Learning units of two gloo ranks each (torch's elastic launcher through ``--nproc-per-node 2``), replicated and
sharded (``--shard-model``), real processes on 127.0.0.1: rounds between the units, identical θ on a replicated
unit's ranks, token weights of all ranks, a rank SIGKILLed (the launcher restarts its unit, which rejoins from the
swarm while the other unit trains on), the launcher SIGKILLed (its ranks go with it), and a sharded unit's
checkpoint, resume and export."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from swarms import close_leaving_nothing, quick_swarm
from transformers import AutoModelForCausalLM

from bench.swarm import QUICK_UNIT_FLAGS, Swarm
from p2p_diloco.checkpoint import load_checkpoint
from p2p_diloco.lifecycle import descendant_pids, is_running
from p2p_diloco.unit.events import Eval, Join, OuterRound, OuterRoundBegin, ReplicaProbe, Stop, read_events

pytestmark = pytest.mark.swarm

RANKS = ("--nproc-per-node", "2", "--threads", "1", "--max-restarts", "2")
TOKENS_PER_RANK_STEP = 4 * 64  # QUICK_UNIT_FLAGS: 4 sequences of 64 tokens
INNER_STEPS = int(QUICK_UNIT_FLAGS[QUICK_UNIT_FLAGS.index("--inner-steps") + 1])


@pytest.fixture
def swarm(tmp_path: Path):
    # Units start as new interpreters here: started from the fork server, a sharded unit's rank 1 aborted at its
    # clean exit ("terminate called without an active exception", so the launcher restarted the unit) in 2 of 4
    # runs, and in none of 4 started as users start them. Not understood; these tests keep the users' start.
    swarm = quick_swarm(tmp_path, preloaded=False)
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
    """a: two replicas (DDP); b: θ sharded over its two ranks (FSDP). They average as any two units do."""
    maddr = swarm.bootstrap("bootstrap")
    swarm.unit("a", [maddr], *RANKS)
    swarm.unit("b", [maddr], *RANKS, "--shard-model")
    swarm.wait_for(lambda: all(len(merged_with_other(swarm, n)) >= 3 for n in ("a", "b")), timeout_s=240,
                   what="3 rounds merged between the two units")  # fmt: skip

    def probes_of_both_ranks() -> tuple[dict[int, list[float]], dict[int, list[float]], list[int]] | None:
        """θ probes of a's two ranks at the start and after each merge (written at the step after it)."""
        lead, follower = replica_probes(swarm, "a", 0), replica_probes(swarm, "a", 1)
        shared = sorted(set(lead) & set(follower))
        return (lead, follower, shared) if len(shared) >= 4 else None

    lead, follower, shared = swarm.wait_for(probes_of_both_ranks, timeout_s=60,
                                            what="θ probes of both ranks of a, at the start and 3 merges")  # fmt: skip
    assert all(lead[step] == follower[step] for step in shared)
    for name in ("a", "b"):
        (join,) = swarm.events(name, Join)
        assert join.ranks == 2, join
        # a round's weight is the tokens of both ranks since the unit's previous round began
        steps = [0] + [event.inner_step for event in swarm.events(name, OuterRoundBegin)]
        weights = [event.weight for event in swarm.events(name, OuterRoundBegin)]
        assert weights == [(now - before) * TOKENS_PER_RANK_STEP * 2 for before, now in zip(steps, steps[1:])]
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

    # SIGKILL of the launcher alone (the unit's top process): its ranks and their hivemind processes go with it
    tree = swarm.kill_main_process("b")
    assert len(tree) >= 7, tree  # two ranks; rank 0's watchdog, DHT, averagers, state server and p2pd
    swarm.wait_for(lambda: not any(is_running(pid) for pid in tree), timeout_s=15,
                   what="b's ranks and their processes to exit after their launcher")  # fmt: skip


def test_a_sharded_unit_trains_checkpoints_resumes_and_exports(swarm: Swarm, tmp_path: Path) -> None:
    """--shard-model (FSDP over two gloo ranks): the unit trains alone (quorum 1), evaluates φ with both ranks,
    checkpoints its AdamW state gathered from both shards, exits cleanly with an export that transformers loads; the
    same work dir resumes from that checkpoint (moments included) and trains on."""
    maddr = swarm.bootstrap("bootstrap")
    export = tmp_path / "export"
    flags = (*RANKS, "--shard-model", "--checkpoint-every-rounds", "1", "--save-dir", str(export))
    swarm.unit("s", [maddr], *flags, "--max-steps", str(3 * INNER_STEPS))
    swarm.wait_for(lambda: swarm.processes["s"].poll() is not None, timeout_s=240, what="the sharded unit's exit")
    assert swarm.processes["s"].returncode == 0, swarm.tail("s", 60)
    (join,) = swarm.events("s", Join)
    assert join.ranks == 2 and join.source == "initial weights", join
    (first,) = swarm.events("s", Stop)
    assert first.inner_step == 3 * INNER_STEPS, first
    evals = [event.eval_loss for event in swarm.events("s", Eval) if event.eval_loss is not None]
    assert evals[-1] < evals[0] - 0.5, evals
    checkpoint = load_checkpoint(swarm.root / "s" / "checkpoint.pt")
    assert checkpoint is not None
    moments = checkpoint["inner"]["optimizer"]["state"]
    trained = {name: param for name, param in AutoModelForCausalLM.from_pretrained(export).named_parameters()}
    assert set(moments) <= set(trained) and len(moments) == len(checkpoint["local_params"]), sorted(moments)[:3]
    for name, state in moments.items():  # whole moments, gathered from both ranks' shards
        assert state["exp_avg"].shape == trained[name].shape, name
    for phi, (name, param) in zip(checkpoint["global_params"], trained.items()):
        assert torch.equal(phi, param.detach()), name  # the export is φ

    resumed_at = time.time()
    swarm.unit("s", [maddr], *flags, "--max-steps", str(5 * INNER_STEPS))
    swarm.wait_for(lambda: swarm.processes["s"].poll() is not None, timeout_s=240, what="the resumed unit's exit")
    assert swarm.processes["s"].returncode == 0, swarm.tail("s", 60)
    (rejoin,) = swarm.events("s", Join, resumed_at)
    assert rejoin.source == "checkpoint" and rejoin.outer_round == first.outer_round, (rejoin, first)
    (stop,) = swarm.events("s", Stop, resumed_at)
    assert stop.inner_step == 5 * INNER_STEPS and stop.outer_round > first.outer_round, (stop, first)
    assert "afresh" not in (swarm.root / "s" / "stdout.log").read_text()
