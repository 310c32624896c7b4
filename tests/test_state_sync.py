"""A joiner's download between real DHT nodes and averagers on 127.0.0.1: signed donor records, the declared
checksum, rounds far ahead not believed, and a state taken only once two donors' downloads agree (φ and the size of
the outer momentum)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import torch
from swarms import RUN_ID, record_peers

from p2p_diloco.checkpoint import payload_digest
from p2p_diloco.config import NetworkSection
from p2p_diloco.network.dht import peer_identity, start_dht, stop_dht, visible_multiaddrs
from p2p_diloco.network.membership import RunAccess
from p2p_diloco.network.records import DonorRecord, SwarmRecords, record_validators
from p2p_diloco.network.relays import CLIENT
from p2p_diloco.network.state_sync import StateServer, SwarmState

pytestmark = pytest.mark.swarm

SHAPES = [(4, 3), (5,)]
KEY = "state-test_state"


def state(value: float, outer_round: int, momentum: float = 0.01) -> SwarmState:
    return SwarmState([torch.full(shape, value) for shape in SHAPES], [torch.full(s, momentum) for s in SHAPES],
                      [outer_round], inner_step=10 * outer_round, tokens=640 * outer_round)  # fmt: skip


@pytest.fixture
def servers() -> Iterator[list[StateServer]]:
    """Four units' state servers, each on its own DHT node (the last one is the joiner)."""
    with record_peers(4) as peers:
        made = [StateServer(peer.dht, KEY, [torch.zeros(s) for s in SHAPES], peer) for peer in peers]
        try:
            yield made
        finally:
            for server in made:
                server.shutdown()


def download_until(joiner: StateServer, found: int, timeout_s: float = 30.0) -> SwarmState | None:
    """The joiner's download once it reads ``found`` donor records (their stores are not awaited)."""
    deadline = time.monotonic() + timeout_s
    while len(joiner._believed_donors(failed=set())) < found and time.monotonic() < deadline:
        time.sleep(0.2)
    return joiner.download(timeout_s=10.0)


def phi_value(downloaded: SwarmState | None) -> float:
    assert downloaded is not None
    return float(downloaded.global_params[0][0, 0])


def test_a_joiner_takes_the_state_two_donors_agree_on_over_a_fresher_poisoned_one(servers, caplog) -> None:
    honest, other, poisoned, joiner = servers
    honest.publish(state(0.5, 7))
    other.publish(state(0.5 + 1e-4, 7))
    poisoned.publish(state(1000.0, 8))  # fresher, so tried first
    caplog.set_level("INFO", logger="p2p_diloco.network.state_sync")
    downloaded = download_until(joiner, found=3)
    assert downloaded is not None and downloaded.fragment_rounds == [7] and downloaded.inner_step == 70
    assert abs(phi_value(downloaded) - 0.5) < 1e-3
    assert "disagree" in caplog.text and "corroborated" in caplog.text


def test_a_round_far_ahead_of_the_other_donors_is_not_believed(servers, caplog) -> None:
    honest, other, poisoned, joiner = servers
    honest.publish(state(0.5, 7))
    other.publish(state(0.5, 7))
    poisoned.publish(state(0.5, 1_000_000))
    downloaded = download_until(joiner, found=2)
    assert downloaded is not None and downloaded.fragment_rounds == [7]
    assert "claims outer round 1000000" in caplog.text
    assert sorted(joiner.declared_rounds().values()) == [7, 7, 1_000_000]  # the join rule judges them (joining.py)


def _cut_off(server: StateServer) -> None:
    """What a joiner received from a donor shut down while it streamed (seen in CI): bytes its record does not
    declare."""
    with server._averager.get_tensors() as buffers:
        buffers[0].add_(1.0)


@pytest.mark.parametrize("death", [StateServer.shutdown, _cut_off], ids=["gone", "cut-off-stream"])
def test_a_dead_donors_record_does_not_hold_the_live_donors_round_down(
    servers, caplog, death: Callable[[StateServer], None]
) -> None:
    """A unit that died (and restarted under a new peer id) leaves its record behind for DONOR_TTL_S: once a download
    from it failed or was rejected, the live donor far ahead of it is believed."""
    dead, live, _, joiner = servers
    dead.publish(state(0.2, 1))
    live.publish(state(0.5, 10))
    deadline = time.monotonic() + 30.0
    while len(joiner._donors.read_donors(KEY)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [donor.fragment_rounds for donor in joiner._believed_donors(failed=set())] == [[1]]  # held down
    death(dead)
    downloaded = joiner.download(timeout_s=10.0)
    assert downloaded is not None and downloaded.fragment_rounds == [10]
    assert "claims outer round 10" in caplog.text and "taken uncorroborated" in caplog.text


def test_a_state_whose_momentum_is_scaled_is_not_corroborated_by_one_that_agrees_on_phi(servers, caplog) -> None:
    honest, other, poisoned, joiner = servers
    honest.publish(state(0.5, 7))
    other.publish(state(0.5, 7, momentum=0.012))
    poisoned.publish(state(0.5, 8, momentum=1000.0))  # fresher, so tried first
    downloaded = download_until(joiner, found=3)
    assert downloaded is not None and downloaded.fragment_rounds == [7]
    assert float(downloaded.momentum[0].abs().max()) < 1
    assert "outer momentum norms" in caplog.text


def test_downloads_that_disagree_one_to_one_give_no_state(servers, caplog) -> None:
    honest, poisoned, _, joiner = servers
    honest.publish(state(0.5, 7))
    poisoned.publish(state(-3.0, 7))
    assert download_until(joiner, found=2) is None
    assert "disagree" in caplog.text


def test_a_lone_donor_is_taken_and_a_state_unlike_its_declaration_is_not(
    servers: list[StateServer], caplog: pytest.LogCaptureFixture
) -> None:
    donor, _, _, joiner = servers
    donor.publish(state(0.5, 3))
    assert phi_value(download_until(joiner, found=1)) == 0.5
    assert "uncorroborated" in caplog.text
    records: SwarmRecords = donor._donors  # type: ignore[assignment]
    declared = records.read_donors(KEY)[donor._peer_id]
    assert declared.digest == payload_digest(list(donor._averager.get_current_state()[1]))
    records.publish_donor(DonorRecord(**{**declared.dict(), "digest": "0" * 64}))  # it declares another state
    deadline = time.monotonic() + 30
    while records.read_donors(KEY)[donor._peer_id].digest != "0" * 64 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert joiner.download(timeout_s=10.0) is None
    assert "differs from the one the donor declared" in caplog.text


def test_units_at_momentum_zero_serve_phi_alone_and_a_unit_with_momentum_takes_it(caplog) -> None:
    """A unit at outer momentum 0 keeps no momentum and serves [φ, counters]; two such donors corroborate
    each other, and a joiner that keeps a momentum takes their φ with none (its engine starts m at zero)."""
    with record_peers(3) as peers:
        template = [torch.zeros(s) for s in SHAPES]
        made = [StateServer(peer.dht, KEY, template, peer, momentum=index == 2) for index, peer in enumerate(peers)]
        try:
            *donors, joiner = made
            with pytest.raises(ValueError, match="momentum tensors"):
                donors[0].publish(state(0.5, 7))  # a momentum where the server keeps none
            for donor in donors:
                donor.publish(SwarmState(state(0.5, 7).global_params, [], [7], inner_step=70, tokens=4480))
            caplog.set_level("INFO", logger="p2p_diloco.network.state_sync")
            downloaded = download_until(joiner, found=2)
            assert downloaded is not None and downloaded.momentum == [] and phi_value(downloaded) == 0.5
            assert "corroborated" in caplog.text
            served = donors[0]._averager.get_current_state()[1]
            assert [tuple(tensor.shape) for tensor in served] == [*SHAPES, (4,)]  # one copy of φ and the counters
        finally:
            for server in made:
                server.shutdown()


def test_a_client_mode_unit_downloads_state_and_serves_none() -> None:
    """A unit behind NAT (its DHT in client mode, reachability.py) takes a reachable donor's state; its own
    publications are checked, then dropped: no declaration (hivemind cannot serve state from a client)."""
    with record_peers(1) as (server,):
        identity = peer_identity(None)
        validators = record_validators(RunAccess(RUN_ID), identity.key)
        network = NetworkSection(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=visible_multiaddrs(server.dht))
        dht = start_dht(network, identity=identity, record_validators=validators, reachability=CLIENT)
        client = SwarmRecords(dht, RunAccess(RUN_ID), validators)
        made = [StateServer(peers.dht, KEY, [torch.zeros(s) for s in SHAPES], peers) for peers in (server, client)]
        try:
            donor, behind_nat = made
            donor.publish(state(0.5, 3))
            assert phi_value(download_until(behind_nat, found=1)) == 0.5
            with pytest.raises(ValueError, match="momentum tensors"):
                behind_nat.publish(SwarmState(state(0.5, 3).global_params, [], [3], inner_step=30, tokens=1920))
            behind_nat.publish(state(0.7, 4))
            assert behind_nat._declaring is None
            assert set(server.read_donors(KEY)) == {donor._peer_id}
        finally:
            for made_server in made:
                made_server.shutdown()
            stop_dht(dht)
