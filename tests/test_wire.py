"""Wire byte counting from the kernel's TCP socket statistics."""

from __future__ import annotations

import shutil

import hivemind
import pytest
from hivemind.utils import get_dht_time

from p2p_diloco.network.dht import stop_dht
from p2p_diloco.network.wire import WireBytes, WireCounter, parse_socket_stats

SAMPLE = (
    'ESTAB 0 0 127.0.0.1:35475 127.0.0.1:41699 users:(("p2pd",pid=21201,fd=14)) ino:931729 sk:1001 <->\n'
    "\t ts sack bbr wscale:10,10 rto:204 bytes_sent:12142 bytes_retrans:66 bytes_acked:12047 bytes_received:9000\n"
    'ESTAB 0 0 127.0.0.1:41699 127.0.0.1:35475 users:(("p2pd",pid=999,fd=9)) ino:931730 sk:1002 <->\n'
    "\t ts sack bbr bytes_sent:5 bytes_received:7\n"
    'ESTAB 0 0 127.0.0.1:22 127.0.0.1:5000 users:(("sshd",pid=21201,fd=3)) ino:11 sk:3 <->\n'
    "\t bytes_sent:100 bytes_received:100\n"
)


def test_parse_keeps_only_the_given_p2pd_processes() -> None:
    assert parse_socket_stats(SAMPLE, {21201}) == {"931729": WireBytes(sent=12142, received=9000)}
    assert set(parse_socket_stats(SAMPLE, {21201, 999})) == {"931729", "931730"}


@pytest.mark.swarm
@pytest.mark.skipif(shutil.which("ss") is None, reason="iproute2's ss is not installed")
def test_counter_sees_dht_traffic_grow() -> None:
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    second = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs())
    try:
        counter = WireCounter()
        before = counter.sample()
        for index in range(5):
            second.store(f"key{index}", "v" * 1000, get_dht_time() + 30)
        after = counter.sample()
        assert before is not None and after is not None
        assert after.sent - before.sent >= 5000 and after.received - before.received >= 5000
    finally:
        stop_dht(second)
        stop_dht(first)
