"""A swarm on emulated WAN links: a bootstrap node and two learning units as real processes, each in its own network
namespace behind a 20 Mbit/s tbf link (see bench/chaos/namespaces.py), streaming two fragments with the int8
codec and fp32 consensus rounds. The bytes that crossed each unit's link are checked against what those rounds send.

Root only (namespaces and tc); skipped elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from swarms import close_leaving_nothing

from bench.chaos.namespaces import NamespaceError, Namespaces
from bench.chaos.swarm_target import SwarmTarget
from bench.swarm import Swarm
from bench.training import TrainingSetup
from p2p_diloco.fragments import Fragment, partition
from p2p_diloco.presets import CORPUS, TINY_MODEL
from p2p_diloco.settings import load_config
from p2p_diloco.unit.events import ConsensusBegin, ConsensusRound, Eval, Join
from p2p_diloco.unit.model import load_model

pytestmark = pytest.mark.swarm

PREFIX = "pdcw-"
RATE_MBIT = 20.0
UNITS = ("unit0", "unit1")
FRAGMENTS = 2
INNER_STEPS = 8
CONSENSUS_EVERY = 2
# quorum 2 and groups of 2: no round completes alone, so both units stay at round 0 until they meet and neither
# downloads the other's state (whose bytes would blur the count); a group starts as soon as both are in it.
UNIT_FLAGS = (
    "--fragments", str(FRAGMENTS), "--codec", "int8", "--max-in-flight", "2",
    "--consensus-every-rounds", str(CONSENSUS_EVERY), "--quorum", "2", "--target-group-size", "2",
    "--allreduce-timeout-s", "10", "--join-timeout-s", "30",
    "--settle-rounds", "0",  # the byte count covers the training rounds only: no fp32 settle rounds at exit
    # rounds H steps apart: on the clock schedule (the default) one run of this short test ended worse than it began
    # (eval 8.35 -> 9.80: fragment 1 merged three times while fragment 2's rounds found no partner), not understood yet
    "--schedule", "steps",
)  # fmt: skip
STARTUP_S = 60.0  # from the start of the bootstrap node to the rounds waited for (measured: 12-25 s)
INT8_BYTES, FP32_BYTES = 1, 4
# Per completed fragment round, the bytes a unit sent beyond the consensus rounds' payload (int8 all-reduce of the
# fragment: ~1 byte per element, plus DHT, matchmaking and failed attempts) stay below this many bytes per element;
# fp32 proposals (φ and m) would need 8.
MAX_BYTES_PER_ELEMENT = 2.5


@pytest.fixture
def network() -> Iterator[Namespaces]:
    try:
        namespaces = Namespaces(["bootstrap", *UNITS], prefix=PREFIX, rate_mbit=RATE_MBIT)
    except NamespaceError as error:
        pytest.skip(f"network namespaces unavailable here: {error}")
    try:
        yield namespaces
    finally:
        namespaces.close()


def fragments() -> list[Fragment]:
    config = load_config(model__model_config_path=str(TINY_MODEL), data__dataset=str(CORPUS))
    trained = [param for param in load_model(config.model).model.parameters() if param.requires_grad]
    return partition([param.shape for param in trained], FRAGMENTS)


def finite_loss(event: Eval) -> float:
    loss = event.eval_loss
    assert isinstance(loss, float) and math.isfinite(loss), event
    return loss


def test_int8_streaming_swarm_crosses_rate_limited_links(network: Namespaces, tmp_path: Path) -> None:
    """Both units average both fragments together and apply a consensus round; each unit's link carried at least
    the payload of those rounds (int8 fragment rounds: 1 byte per element; fp32 consensus rounds: 4 bytes per element
    of their fragment) and, beyond the consensus rounds, under MAX_BYTES_PER_ELEMENT per element of the fragment
    rounds. Both units' consensus models improved."""
    setup = TrainingSetup(batch_size=4, inner_steps=INNER_STEPS, eval_every_steps=10**6)
    target = SwarmTarget("wan", len(UNITS), tmp_path, network, setup, budget_s=600.0, extra_flags=UNIT_FLAGS)
    before = {name: network.interface_bytes(name) for name in UNITS}
    try:
        target.start()
        check_links(target.swarm, network, before)
    finally:
        close_leaving_nothing(target.swarm)


def check_links(swarm: Swarm, network: Namespaces, before: dict[str, tuple[int, int]]) -> None:
    """Wait for the rounds, stop the units, then check what their links carried (see the test's docstring)."""

    def paired(name: str) -> bool:
        fragments_paired = {r.fragment for r in swarm.rounds(name) if r.group_size == 2}
        applied = [e for e in swarm.events(name, ConsensusRound) if e.applied]
        return fragments_paired == set(range(FRAGMENTS)) and bool(applied)

    what = "both fragments averaged in pairs and a consensus round applied by each unit"
    swarm.wait_for(lambda: all(paired(name) for name in UNITS), STARTUP_S, what)
    codes = swarm.stop(list(UNITS), grace_s=60.0)
    assert codes == [0] * len(UNITS), f"exit codes {codes}\n{swarm.tails()}"
    after = {name: network.interface_bytes(name) for name in UNITS}

    split = fragments()

    def consensus_bytes(events: Sequence[ConsensusRound | ConsensusBegin]) -> int:
        return sum(FP32_BYTES * split[event.fragment].numel for event in events)

    for name in UNITS:
        assert [join.source for join in swarm.events(name, Join)] == ["initial weights"]  # no state download
        sent = after[name][0] - before[name][0]
        rounds = [r for r in swarm.rounds(name) if r.group_size == 2]
        elements = sum(split[r.fragment].numel for r in rounds)
        consensus = [e for e in swarm.events(name, ConsensusRound) if e.group_size == 2]
        consensus_begun = swarm.events(name, ConsensusBegin)  # a round cancelled on exit may have sent part
        payload = INT8_BYTES * elements + consensus_bytes(consensus)
        beyond_consensus = (sent - consensus_bytes(consensus_begun)) / elements
        print(
            f"{name}: sent {sent / 1e6:.2f} MB; payload {payload / 1e6:.2f} MB of {len(rounds)} int8 fragment rounds "
            f"({elements / 1e6:.2f} M elements) and {len(consensus)} fp32 consensus rounds "
            f"({consensus_bytes(consensus) / 1e6:.2f} MB, {len(consensus_begun)} begun); beyond the consensus rounds "
            f"{beyond_consensus:.2f} B per fragment element (fp32 proposals: {2 * FP32_BYTES})"
        )
        assert sent >= payload
        assert beyond_consensus <= MAX_BYTES_PER_ELEMENT
        evals = {event.reason: finite_loss(event) for event in swarm.events(name, Eval)}
        assert evals["final"] < evals["join"], evals
