"""The tests' real swarms (``bench/swarm.py``) with quick units: the ~1 M parameter GPT-2 of the tiny preset, 4 x 64
tokens per step, a round every 10 steps."""

from __future__ import annotations

from pathlib import Path

from bench.swarm import Swarm, wait_until
from p2p_diloco.lifecycle import is_running, kill_process_tree

QUICK_UNIT_FLAGS = ("--seq-len", "64", "--batch-size", "4", "--inner-steps", "10", "--join-timeout-s", "30")


def quick_swarm(root: Path) -> Swarm:
    return Swarm(root, unit_flags=QUICK_UNIT_FLAGS)


def close_leaving_nothing(swarm: Swarm, gone_s: float = 15.0) -> None:
    """Close ``swarm``, then fail if any of its processes (those faults were applied to included) is still alive
    ``gone_s`` later (they are SIGKILLed first, so nothing leaks into the next test)."""
    pids = swarm.live_pids() | swarm.faulted_pids
    swarm.close()  # thaws frozen trees first
    try:
        wait_until(lambda: not any(is_running(pid) for pid in pids), gone_s, "every process of the swarm to exit")
    except AssertionError:
        survivors = [pid for pid in pids if is_running(pid)]
        for pid in survivors:
            kill_process_tree(pid)
        raise AssertionError(f"processes outlived the swarm: {survivors}") from None
