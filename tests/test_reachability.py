"""Units that other peers cannot connect to (reachability.py, relays.py): the dial-back request's validation, the
choice of how a unit is reached, the p2p daemon's static relays, and a real swarm in network namespaces where both
units' namespaces drop every inbound connection, as home routers do: one is reached through the bootstrap node's
relay, the other joins as a client. The swarm test needs root, iptables and iproute2 (``.ci/run`` installs iptables);
elsewhere it is skipped, except under CI, where it fails.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hivemind.p2p import P2P, PeerID
from swarms import close_leaving_nothing

from bench.chaos.namespaces import PUBLIC_SUBNET, NamespaceError, Namespaces
from bench.swarm import QUICK_UNIT_FLAGS, Swarm
from p2p_diloco.config import NetworkSection
from p2p_diloco.network.dht import NetworkError
from p2p_diloco.network.reachability import MAX_DIAL_BACK_ADDRESSES, dial_back_addresses, reachability_of
from p2p_diloco.network.relays import CLIENT, DIRECT, Reachability, relay_candidates, use_static_relays
from p2p_diloco.ops.bootstrap_node import run_bootstrap
from p2p_diloco.unit.events import Join

ASKER = "12D3KooWSc2MxDuUQ9hy5vmrpLeEADkw24Jucrz4uYbcB8Kc3f8k"
STRANGER = "12D3KooWGkLon2PCgQvb9pLupPTKKmr2KpUMKAxcjddrJBqv4SQh"
CHECKER = "12D3KooWQWDqPVufKyF9FgidoVdUce3R84gawqYmNmgk2SDioheW"


def test_dial_back_dials_only_the_askers_direct_addresses_or_circuits_through_the_checker() -> None:
    asker, checker = PeerID.from_base58(ASKER), PeerID.from_base58(CHECKER)
    own = [
        f"/ip4/10.0.0.1/tcp/4001/p2p/{ASKER}".encode(),
        f"/ip6/::1/tcp/4001/p2p/{ASKER}".encode(),
        f"/ip4/10.0.0.2/tcp/1/p2p/{CHECKER}/p2p-circuit/p2p/{ASKER}".encode(),
    ]
    assert dial_back_addresses(asker, own, checker) == [address.decode() for address in own]
    refused = [
        f"/ip4/10.0.0.1/tcp/4001/p2p/{STRANGER}",  # someone else's address
        f"/ip4/10.0.0.1/udp/4001/quic/p2p/{ASKER}",
        f"/ip4/10.0.0.2/tcp/1/p2p/{STRANGER}/p2p-circuit/p2p/{ASKER}",  # through another relay
        f"/ip4/10.0.0.2/tcp/1/p2p/{CHECKER}/p2p-circuit/p2p/{STRANGER}",  # to someone else through this checker
        f"/ip4/10.0.0.2/tcp/1/p2p/{CHECKER}/p2p-circuit",
        "/ip4/10.0.0.1/tcp/4001",  # no peer id
        "not a multiaddr",
    ]
    for address in refused:
        with pytest.raises(ValueError):
            dial_back_addresses(asker, [address.encode()], checker)
    with pytest.raises(ValueError):
        dial_back_addresses(asker, [], checker)
    with pytest.raises(ValueError):
        dial_back_addresses(asker, own[:1] * (MAX_DIAL_BACK_ADDRESSES + 1), checker)


def test_reachability_choice_without_a_check() -> None:
    initial = [f"/ip4/127.0.0.1/tcp/4001/p2p/{ASKER}"]
    assert reachability_of(NetworkSection(reachability="public", initial_peers=initial)) == DIRECT
    assert reachability_of(NetworkSection(reachability="private", initial_peers=initial, use_relays=False)) == CLIENT
    assert reachability_of(NetworkSection()) == DIRECT  # the first peer of a swarm: no one to ask, it must be reachable
    with pytest.raises(NetworkError, match="needs --initial-peers"):
        reachability_of(NetworkSection(reachability="private"))


def test_relays_are_direct_addresses_one_per_peer() -> None:
    relay = f"/ip4/10.0.0.2/tcp/1/p2p/{CHECKER}"
    addresses = [relay, f"/dns4/relay.example/tcp/2/p2p/{CHECKER}", f"{relay}/p2p-circuit/p2p/{ASKER}",
                 "/ip4/10.0.0.3/tcp/1", f"/ip4/10.0.0.1/tcp/4001/p2p/{ASKER}"]  # fmt: skip
    assert relay_candidates(addresses) == [relay, f"/ip4/10.0.0.1/tcp/4001/p2p/{ASKER}"]
    relayed = Reachability("relayed", (relay,))
    assert relayed.p2p_options() == {
        "use_auto_relay": True,
        "trusted_relays": [relay],
        "force_reachability": "private",
        "announce_maddrs": [f"{relay}/p2p-circuit"],
    }
    assert DIRECT.p2p_options() == CLIENT.p2p_options() == {} and CLIENT.client_mode and not relayed.client_mode
    with pytest.raises(ValueError):
        Reachability("relayed")
    with pytest.raises(ValueError):
        Reachability("client", (relay,))


def test_trusted_relays_are_static_relays_of_the_p2p_daemon() -> None:
    """Without -relayDiscovery=0 the daemon reserves its first relay slot only after 3 minutes (relays.py)."""
    use_static_relays()
    use_static_relays()  # idempotent
    flags = P2P._make_process_args("p2pd", autoRelay=True, trustedRelays="/ip4/10.0.0.2/tcp/1/p2p/" + CHECKER)
    assert flags.count("-relayDiscovery=0") == 1
    assert "-relayDiscovery=0" not in P2P._make_process_args("p2pd", autoRelay=True)


def test_a_private_bootstrap_node_is_refused(tmp_path: Path) -> None:
    network = NetworkSection(reachability="private", identity_path=str(tmp_path / "bootstrap.key"))
    with pytest.raises(NetworkError, match="must be reachable"):
        run_bootstrap(network)


@pytest.fixture
def firewalled() -> Iterator[Namespaces]:
    """Namespaces for a bootstrap node and two units, whose namespaces drop every inbound connection, on addresses
    libp2p takes for public ones (the bootstrap node relays bulk data only once it is found public)."""
    try:
        namespaces = Namespaces(["bootstrap", "unit0", "unit1"], prefix="pdcr-", subnet=PUBLIC_SUBNET)
    except NamespaceError as error:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"network namespaces unavailable here: {error}")
    try:
        try:
            namespaces.drop_inbound("unit0")
            namespaces.drop_inbound("unit1")
        except NamespaceError as error:
            if os.environ.get("CI"):
                raise
            pytest.skip(str(error))
        yield namespaces
    finally:
        namespaces.close()


@pytest.mark.swarm
def test_firewalled_units_serve_state_and_average_through_a_relay(firewalled: Namespaces, tmp_path: Path) -> None:
    """Both units fail the bootstrap node's dial-back check. unit0 is then reached through the bootstrap node's relay
    (confirmed by a 256 KiB check through it) and merges a round alone; unit1, with --no-use-relays, joins as a
    client. Neither can open a connection to the other: unit1 downloads unit0's state through the relay, then both
    merge rounds in groups of two (unit1's quorum is 2), which unit0 leads and reduces, through the relay."""
    swarm = Swarm(tmp_path, network=firewalled, unit_flags=QUICK_UNIT_FLAGS)
    try:
        bootstrap = swarm.bootstrap("bootstrap")
        swarm.unit("unit0", [bootstrap])
        swarm.wait_for(lambda: swarm.rounds("unit0"), 90, "unit0 merged a round")
        swarm.unit("unit1", [bootstrap], "--no-use-relays", "--quorum", "2")
        joined = swarm.wait_for(lambda: swarm.events("unit1", Join), 90, "unit1 joined")
        assert joined[0].source == "swarm" and joined[0].outer_round >= 1
        swarm.wait_for(lambda: len(swarm.rounds("unit1")) >= 2, 150, "two rounds of unit1")
        assert all(merged.group_size == 2 for merged in swarm.rounds("unit1"))
        logs = {name: (tmp_path / name / "stdout.log").read_text() for name in ("unit0", "unit1")}
        for log in logs.values():
            assert "other peers cannot connect to this unit" in log
        assert "other peers reach this unit through 1 relay(s)" in logs["unit0"]
        assert "reachability=relayed relays=1" in logs["unit0"]
        assert f"{bootstrap}/p2p-circuit/p2p/" in swarm.events("unit0", Join)[0].multiaddrs
        assert "joining as a client (--no-use-relays)" in logs["unit1"] and "reachability=client" in logs["unit1"]
        for name in ("unit0", "unit1"):
            print(name, [(r.outer_round, r.group_size, round(r.seconds, 2)) for r in swarm.rounds(name)])
    finally:
        close_leaving_nothing(swarm)
