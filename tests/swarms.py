"""The tests' real swarms (``bench/swarm.py``) with quick units (``QUICK_UNIT_FLAGS`` there), their nodes started
from a fork server that imported torch, transformers and datasets once (``bench/preloaded.py``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil

from bench.swarm import QUICK_UNIT_FLAGS, Swarm, wait_until
from p2p_diloco.config import NetworkSection
from p2p_diloco.lifecycle import is_running, kill_process_tree
from p2p_diloco.network.dht import peer_identity, start_dht, stop_dht, visible_multiaddrs
from p2p_diloco.network.membership import RunAccess
from p2p_diloco.network.records import SwarmRecords, record_validators

RUN_ID = "test"
TORCH_SHM_MANAGER = "torch_shm_manager"
"""torch's helper for shared memory: started once per process that shares tensors, it exits with its last client."""
FORK_SERVER_COMMANDS = ("from multiprocessing.forkserver import", "from multiprocessing.resource_tracker import")
"""The fork server the swarms start their nodes from (bench/preloaded.py) and multiprocessing's resource tracker:
started by this process once, they exit with it."""


def session_helper(process: psutil.Process) -> bool:
    """Whether ``process`` lives as long as this test session by design (torch's shared-memory manager, or a helper
    of the fork server), rather than having been left behind by a test. psutil.Error if it is gone."""
    command = " ".join(process.cmdline())
    return TORCH_SHM_MANAGER in process.name() or (
        process.ppid() == os.getpid() and any(helper in command for helper in FORK_SERVER_COMMANDS)
    )


def quick_swarm(root: Path, *unit_flags: str, preloaded: bool = True) -> Swarm:
    """A swarm on 127.0.0.1 whose units are quick units with ``unit_flags`` added; ``preloaded``: its nodes are
    forked from the fork server (else started as new interpreters, as a user starts them)."""
    return Swarm(root, unit_flags=(*QUICK_UNIT_FLAGS, *unit_flags), preloaded=preloaded)


def close_leaving_nothing(swarm: Swarm, gone_s: float = 15.0) -> None:
    """Kill ``swarm`` (SIGKILL of every process group: any process may be killed at any moment), then fail if any of
    its processes (those faults were applied to included) is still alive ``gone_s`` later (they are SIGKILLed one by
    one first, so nothing leaks into the next test). A test that asserts clean exits stops its units itself first
    (``Swarm.stop``): a unit's clean exit runs its final and settle rounds, which would cost every test up to the
    close's grace (15 s)."""
    pids = swarm.live_pids() | swarm.faulted_pids
    swarm.close(grace_s=0.0)  # thaws frozen trees first
    try:
        wait_until(lambda: not any(is_running(pid) for pid in pids), gone_s, "every process of the swarm to exit")
    except AssertionError:
        survivors = [pid for pid in pids if is_running(pid)]
        for pid in survivors:
            kill_process_tree(pid)
        raise AssertionError(f"processes outlived the swarm: {survivors}") from None


@contextlib.contextmanager
def record_peers(
    count: int, access: Callable[[int, str], RunAccess] = lambda _index, _peer_id: RunAccess(RUN_ID)
) -> Iterator[list[SwarmRecords]]:
    """``count`` DHT servers on 127.0.0.1 (each joined through the first), each signing its records with its own fresh
    libp2p identity as a unit does, peer ``index`` with the rules ``access(index, its peer id)``; stopped on exit."""
    started: list[SwarmRecords] = []
    try:
        for index in range(count):
            identity = peer_identity(None)
            rules = access(index, identity.peer_id)
            validators = record_validators(rules, identity.key)
            initial = visible_multiaddrs(started[0].dht) if started else []
            network = NetworkSection(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial)
            dht = start_dht(network, identity=identity, record_validators=validators)
            started.append(SwarmRecords(dht, rules, validators))
        yield started
    finally:
        for peer in started:
            stop_dht(peer.dht)
