"""DHT start/join on 127.0.0.1: identity, address validation, bounded failure, bootstrap node process."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hivemind.p2p import P2P, PeerID

from bench.swarm import wait_until
from p2p_diloco.config import NetworkSection
from p2p_diloco.lifecycle import descendant_pids, group_pids, hivemind_sockets, is_running
from p2p_diloco.network.dht import (
    NetworkError,
    count_routing_peers,
    ensure_identity,
    identity_peer_id,
    start_dht,
    stop_dht,
    validate_multiaddrs,
    visible_multiaddrs,
)
from p2p_diloco.network.relays import CLIENT

pytestmark = pytest.mark.swarm

LOCAL = ["/ip4/127.0.0.1/tcp/0"]


def p2pd_in_my_group() -> set[int]:
    found = set()
    for pid in group_pids(os.getpgid(0)):
        try:
            if b"p2pd" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.add(pid)
        except FileNotFoundError:
            pass
    return found


def my_new_p2pd(before: set[int]) -> set[int]:
    """The p2pd daemons of this process group started since ``before`` by this process's children, or orphaned: the
    other test workers share the group and start their own, under their own children (one did during this wait)."""
    mine = set(descendant_pids(os.getpid()))
    return {pid for pid in p2pd_in_my_group() - before if pid in mine or _parent(pid) == 1}


def _parent(pid: int) -> int | None:
    with contextlib.suppress(FileNotFoundError, IndexError, ValueError):
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return None


def random_peer_id(tmp_path: Path) -> str:
    key = tmp_path / "random.key"
    P2P.generate_identity(str(key))
    return PeerID.from_identity(key.read_bytes()).to_base58()


@pytest.fixture
def dhts():
    """Collects started DHTs and stops them all at teardown."""
    started = []
    yield started
    for dht in started:
        stop_dht(dht)


def test_identity_created_once_and_peer_id_stable(tmp_path, dhts):
    path = tmp_path / "nested" / "dir" / "peer.key"
    assert ensure_identity(path) == path
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    content = path.read_bytes()
    assert ensure_identity(path) == path and path.read_bytes() == content

    network = NetworkSection(host_maddrs=LOCAL, identity_path=str(path))
    first = start_dht(network)
    dhts.append(first)
    first_id = first.peer_id.to_base58()
    assert first_id == identity_peer_id(path)
    assert all(maddr.endswith(f"/p2p/{first_id}") for maddr in visible_multiaddrs(first))
    sockets = hivemind_sockets(descendant_pids(first.pid))
    assert sockets and any(path.exists() for path in sockets)
    stop_dht(first)
    assert not any(path.exists() for path in sockets)
    second = start_dht(network)
    dhts.append(second)
    assert second.peer_id.to_base58() == first_id


def test_corrupt_identity_is_a_network_error(tmp_path):
    path = tmp_path / "bad.key"
    path.write_bytes(b"not a key")
    with pytest.raises(NetworkError, match="not a libp2p private key"):
        ensure_identity(path)


@pytest.mark.parametrize(
    "addr, reason",
    [
        ("garbage", "Must begin with /"),
        ("/ip4/300.1.1.1/tcp/1", "not IPv4"),
        ("/ip4/127.0.0.1/tcp/99999", "range"),
        ("/ip4/127.0.0.1/tcp/1", "missing the /p2p/<peer id>"),
        ("/ip4/127.0.0.1/tcp/1/p2p/notapeerid", "protocol p2p"),
    ],
)
def test_malformed_initial_peer_is_rejected_before_starting(addr, reason):
    with pytest.raises(NetworkError, match=f"malformed multiaddr '{addr}' in --initial-peers: .*{reason}"):
        start_dht(NetworkSection(initial_peers=[addr]))


def test_validate_multiaddrs_accepts_well_formed(tmp_path):
    addr = f"/ip4/127.0.0.1/tcp/4001/p2p/{random_peer_id(tmp_path)}"
    assert validate_multiaddrs([addr], "--initial-peers", require_peer_id=True) == [addr]
    assert validate_multiaddrs(["/ip4/0.0.0.0/tcp/0", "/ip6/::1/tcp/0"], "--host-maddrs") == [
        "/ip4/0.0.0.0/tcp/0",
        "/ip6/::1/tcp/0",
    ]
    with pytest.raises(NetworkError, match="explicit port"):
        start_dht(NetworkSection(announce_maddrs=["/ip4/127.0.0.1/tcp/0"]))


def test_closed_port_fails_fast_and_leaves_nothing(tmp_path):
    before = p2pd_in_my_group()
    addr = f"/ip4/127.0.0.1/tcp/1/p2p/{random_peer_id(tmp_path)}"
    started = time.monotonic()
    with pytest.raises(NetworkError, match="none of the initial peers answered"):
        start_dht(NetworkSection(initial_peers=[addr], join_timeout_s=10))
    assert time.monotonic() - started < 10
    wait_until(lambda: not my_new_p2pd(before), 5, "the failed node's p2pd to exit")


def test_silent_peer_is_bounded_by_join_timeout(tmp_path):
    """A port that accepts TCP but never speaks libp2p: p2pd alone would give up after ~5 s."""
    before = p2pd_in_my_group()
    addr_peer = random_peer_id(tmp_path)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        addr = f"/ip4/127.0.0.1/tcp/{listener.getsockname()[1]}/p2p/{addr_peer}"
        started = time.monotonic()
        with pytest.raises(NetworkError, match="could not join the swarm within 1.5 s"):
            start_dht(NetworkSection(initial_peers=[addr], join_timeout_s=1.5))
        assert time.monotonic() - started < 1.5 + 2.0
    wait_until(lambda: not my_new_p2pd(before), 5, "the killed node's p2pd to exit")


def test_second_node_joins_and_sees_the_first(dhts):
    first = start_dht(NetworkSection(host_maddrs=LOCAL))
    dhts.append(first)
    second = start_dht(NetworkSection(host_maddrs=LOCAL, initial_peers=visible_multiaddrs(first)))
    dhts.append(second)
    client = start_dht(NetworkSection(initial_peers=visible_multiaddrs(first)), reachability=CLIENT)
    dhts.append(client)
    wait_until(lambda: count_routing_peers(second) >= 1 and count_routing_peers(first) >= 1, 10, "routing peers")
    assert count_routing_peers(client) >= 1


BOOTSTRAP_SCRIPT = textwrap.dedent(
    """
    import logging, sys
    from p2p_diloco.ops.bootstrap_node import run_bootstrap
    from p2p_diloco.config import NetworkSection

    logging.basicConfig(level=logging.INFO)
    sys.exit(run_bootstrap(NetworkSection(host_maddrs=["/ip4/127.0.0.1/tcp/0"], run_id="boot-test"),
                           report_every_s=0.2))
    """
)


def test_run_bootstrap_prints_maddrs_and_exits_cleanly_on_sigterm(tmp_path, dhts):
    child = subprocess.Popen(
        [sys.executable, "-c", BOOTSTRAP_SCRIPT],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    children: list[int] = []
    try:
        line = child.stdout.readline()
        assert line.startswith("initial peers: /ip4/127.0.0.1/tcp/"), line
        maddr = line.split(": ", 1)[1].strip()
        assert maddr.endswith("/p2p/" + identity_peer_id(tmp_path / "bootstrap.key"))
        children = descendant_pids(child.pid)
        assert any(b"p2pd" in Path(f"/proc/{pid}/cmdline").read_bytes() for pid in children)
        assert all(os.getpgid(pid) != child.pid for pid in children)  # children live in the reaper's group

        joined = start_dht(NetworkSection(initial_peers=[maddr]), reachability=CLIENT)
        dhts.append(joined)
        os.killpg(child.pid, signal.SIGTERM)  # the whole job: only the node itself is in this group
        assert child.wait(timeout=15) == 0
        wait_until(lambda: not any(is_running(pid) for pid in children), 5, "the bootstrap's DHT and p2pd to exit")
        wait_until(lambda: not _reapers_of(child.pid), 5, "the bootstrap's reaper to exit")
    finally:
        child.kill()
        child.wait()
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _reapers_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and is_running(int(entry.name)):
            try:
                args = (entry / "cmdline").read_bytes().split(b"\0")
            except FileNotFoundError:
                continue
            if b"p2p_diloco.lifecycle" in args and str(pid).encode() in args:
                found.append(int(entry.name))
    return found
