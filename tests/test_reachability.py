"""Units that other peers cannot connect to (reachability.py): the dial-back request's validation, the choice of
client mode, and a real swarm in network namespaces where one unit's namespace drops every inbound connection, as a
home router does. The swarm test needs root, iptables and iproute2 (``.ci/run`` installs iptables); elsewhere it is
skipped, except under CI, where it fails.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hivemind.p2p import PeerID
from swarms import close_leaving_nothing

from bench.chaos.namespaces import NamespaceError, Namespaces
from bench.swarm import QUICK_UNIT_FLAGS, Swarm
from p2p_diloco.bootstrap_node import run_bootstrap
from p2p_diloco.config import NetworkSection
from p2p_diloco.dht import NetworkError
from p2p_diloco.events import Join
from p2p_diloco.reachability import MAX_DIAL_BACK_ADDRESSES, dial_back_addresses, joins_as_client

ASKER = "12D3KooWSc2MxDuUQ9hy5vmrpLeEADkw24Jucrz4uYbcB8Kc3f8k"
STRANGER = "12D3KooWGkLon2PCgQvb9pLupPTKKmr2KpUMKAxcjddrJBqv4SQh"


def test_dial_back_dials_only_direct_addresses_of_the_asker() -> None:
    asker = PeerID.from_base58(ASKER)
    own = [f"/ip4/10.0.0.1/tcp/4001/p2p/{ASKER}".encode(), f"/ip6/::1/tcp/4001/p2p/{ASKER}".encode()]
    assert dial_back_addresses(asker, own) == [address.decode() for address in own]
    refused = [
        f"/ip4/10.0.0.1/tcp/4001/p2p/{STRANGER}",  # someone else's address
        f"/ip4/10.0.0.1/udp/4001/quic/p2p/{ASKER}",
        f"/ip4/10.0.0.2/tcp/1/p2p/{STRANGER}/p2p-circuit/p2p/{ASKER}",  # through a relay
        "/ip4/10.0.0.1/tcp/4001",  # no peer id
        "not a multiaddr",
    ]
    for address in refused:
        with pytest.raises(ValueError):
            dial_back_addresses(asker, [address.encode()])
    with pytest.raises(ValueError):
        dial_back_addresses(asker, [])
    with pytest.raises(ValueError):
        dial_back_addresses(asker, own[:1] * (MAX_DIAL_BACK_ADDRESSES + 1))


def test_client_mode_choice_without_a_check() -> None:
    initial = [f"/ip4/127.0.0.1/tcp/4001/p2p/{ASKER}"]
    assert not joins_as_client(NetworkSection(reachability="public", initial_peers=initial))
    assert joins_as_client(NetworkSection(reachability="private", initial_peers=initial))
    assert not joins_as_client(NetworkSection())  # the first peer of a swarm: no one to ask, it must be reachable
    with pytest.raises(NetworkError, match="needs --initial-peers"):
        joins_as_client(NetworkSection(reachability="private"))


def test_a_private_bootstrap_node_is_refused(tmp_path: Path) -> None:
    network = NetworkSection(reachability="private", identity_path=str(tmp_path / "bootstrap.key"))
    with pytest.raises(NetworkError, match="must be reachable"):
        run_bootstrap(network)


@pytest.fixture
def firewalled() -> Iterator[Namespaces]:
    """Namespaces for a bootstrap node and two units; unit1's drops every inbound connection."""
    try:
        namespaces = Namespaces(["bootstrap", "unit0", "unit1"], prefix="pdcr-")
    except NamespaceError as error:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"network namespaces unavailable here: {error}")
    try:
        try:
            namespaces.drop_inbound("unit1")
        except NamespaceError as error:
            if os.environ.get("CI"):
                raise
            pytest.skip(str(error))
        yield namespaces
    finally:
        namespaces.close()


@pytest.mark.swarm
def test_a_firewalled_unit_joins_and_averages_with_a_reachable_one(firewalled: Namespaces, tmp_path: Path) -> None:
    """unit0 passes the bootstrap node's dial-back check and joins as a server; unit1, whose SYNs from outside go
    unanswered, fails it and joins as a client; then both merge rounds in groups of two (quorum 2: no round completes
    alone), which unit0 leads and reduces."""
    swarm = Swarm(tmp_path, network=firewalled, unit_flags=[*QUICK_UNIT_FLAGS, "--quorum", "2"])
    try:
        bootstrap = swarm.bootstrap("bootstrap")
        swarm.unit("unit0", [bootstrap])
        swarm.wait_for(lambda: swarm.events("unit0", Join), 90, "unit0 joined")
        swarm.unit("unit1", [bootstrap])

        def paired_rounds(name: str) -> int:
            return sum(1 for merged in swarm.rounds(name) if merged.group_size == 2)

        swarm.wait_for(lambda: min(paired_rounds("unit0"), paired_rounds("unit1")) >= 2, 150, "two paired rounds each")
        logs = {name: (tmp_path / name / "stdout.log").read_text() for name in ("unit0", "unit1")}
        assert "other peers can connect to this unit" in logs["unit0"]
        assert "joining as a client" not in logs["unit0"]
        assert "other peers cannot connect to this unit" in logs["unit1"]
        assert "dht started peer_id" in logs["unit1"] and "client_mode=True" in logs["unit1"]
        for name in ("unit0", "unit1"):
            print(name, [(r.outer_round, r.group_size, round(r.seconds, 2)) for r in swarm.rounds(name)])
    finally:
        close_leaving_nothing(swarm)
