"""OuterAverager against a real hivemind averager on 127.0.0.1: a held tensors lock never blocks the caller, and an
averager that keeps it is replaced."""

from __future__ import annotations

import time

import hivemind
import pytest
import torch

from p2p_diloco.averaging import STUCK_MARGIN_S, TENSOR_LOCK_WAIT_S, OuterAverager
from p2p_diloco.dht import stop_dht


@pytest.mark.swarm
def test_a_held_tensors_lock_defers_the_round_instead_of_blocking() -> None:
    """While the averager process would hold its tensors (here: the test holds the lock), begin_round returns False
    at once and poll returns nothing; once the lock is free the round begins and completes alone (quorum 1)."""
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    averager = OuterAverager(dht, "lock-test", [torch.zeros(8)], quorum=1, target_group_size=2, allreduce_timeout_s=5)
    try:
        lock = averager._averager.lock_averaged_tensors  # the lock hivemind's averager process takes
        assert lock.acquire(timeout=5)
        try:
            started = time.monotonic()
            assert averager.begin_round([torch.ones(8)], weight=1.0, outer_round=0, window_s=0.5) is False
            assert time.monotonic() - started < TENSOR_LOCK_WAIT_S + 0.5
            assert averager.poll() is None
        finally:
            lock.release()
        assert averager.begin_round([torch.ones(8)], weight=1.0, outer_round=0, window_s=0.5) is True
        outcome = averager.finish_round(timeout_s=10.0)
        assert outcome is not None and outcome.group_size == 1
        assert torch.equal(outcome.averaged[0], torch.ones(8))
    finally:
        averager.shutdown()
        stop_dht(dht)


@pytest.mark.swarm
def test_an_averager_stuck_with_its_tensors_locked_is_restarted() -> None:
    """A lock that stays taken (as hivemind can leave it after a cancelled step) defers rounds only until it has been
    busy for longer than the all-reduce timeout plus the margin; then a new averager takes the round."""
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    averager = OuterAverager(dht, "stuck-test", [torch.zeros(8)], quorum=1, target_group_size=2, allreduce_timeout_s=1)
    try:
        assert averager._averager.lock_averaged_tensors.acquire(timeout=5)  # never released: the leak
        started = time.monotonic()
        deadline = started + 1 + STUCK_MARGIN_S + 10
        while not averager.begin_round([torch.ones(8)], weight=1.0, outer_round=0, window_s=0.5):
            assert time.monotonic() < deadline, "the stuck averager was never restarted"
            time.sleep(0.2)
        assert time.monotonic() - started >= 1 + STUCK_MARGIN_S
        outcome = averager.finish_round(timeout_s=10.0)
        assert outcome is not None and torch.equal(outcome.averaged[0], torch.ones(8))
    finally:
        averager.shutdown()
        stop_dht(dht)
