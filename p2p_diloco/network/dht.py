"""Joining the swarm's DHT: validated addresses, a persistent libp2p identity, a bounded start, clean failure.

:func:`start_dht` either returns a running :class:`hivemind.DHT` or raises :class:`NetworkError` (one line for the
user) within about ``network.join_timeout_s`` seconds, leaving no DHT process or p2pd behind.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import hivemind
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.utils import get_dht_time
from hivemind.utils.multiaddr import Multiaddr

from p2p_diloco.config import NetworkSection
from p2p_diloco.errors import UserError
from p2p_diloco.lifecycle import (
    descendant_pids,
    ensure_fork_start_method,
    hivemind_sockets,
    is_running,
    kill_process_tree,
)
from p2p_diloco.network.membership import IdentityKey, MembershipError, load_identity_key, peer_id_of
from p2p_diloco.network.relays import DIRECT, Reachability

logger = logging.getLogger(__name__)


class NetworkError(UserError):
    """The swarm cannot be joined or served; the message is one line meant for the user."""


def shared_time() -> float:
    """Seconds since the epoch on the swarm's shared clock (hivemind's DHT time), by which units agree on boundaries
    and records expire."""
    return get_dht_time()


def validate_multiaddrs(addrs: Sequence[str], what: str, *, require_peer_id: bool = False) -> list[str]:
    """Parse every multiaddr; raise NetworkError naming the address, ``what`` (e.g. a flag) and the reason.

    With ``require_peer_id`` (initial peers), each address must end with a valid ``/p2p/<peer id>``.
    """
    valid = []
    for addr in addrs:
        try:
            maddr = Multiaddr(addr)
        except Exception as error:  # the multiaddr parser raises several unrelated exception types
            reason = str(error).replace(f"Invalid MultiAddr '{addr}'", "").lstrip(": ").strip() or "cannot be parsed"
            raise NetworkError(f"malformed multiaddr '{addr}' in {what}: {reason}") from None
        if require_peer_id and "p2p" not in maddr:
            raise NetworkError(f"malformed multiaddr '{addr}' in {what}: missing the /p2p/<peer id> component")
        valid.append(str(maddr))
    return valid


def check_addresses(network: NetworkSection) -> tuple[list[str], list[str], list[str]]:
    """The initial peers, host and announced multiaddrs of ``network``, parsed; NetworkError for a malformed one, an
    announced port 0, or a host TCP port another program already listens on (checked by binding it for an instant,
    so that the daemon's own failure to listen is not reported as unreachable peers)."""
    initial_peers = validate_multiaddrs(network.initial_peers, "--initial-peers", require_peer_id=True)
    host_maddrs = validate_multiaddrs(network.host_maddrs, "--host-maddrs")
    announce_maddrs = validate_multiaddrs(network.announce_maddrs, "--announce-maddrs")
    for addr in announce_maddrs:
        maddr = Multiaddr(addr)
        if any(proto in maddr and maddr[proto] == "0" for proto in ("tcp", "udp")):
            raise NetworkError(f"announce multiaddr '{addr}' in --announce-maddrs needs an explicit port, not 0")
    for addr in host_maddrs:
        _check_port_free(Multiaddr(addr), addr)
    return initial_peers, host_maddrs, announce_maddrs


def _check_port_free(maddr: Multiaddr, addr: str) -> None:
    """NetworkError when ``maddr`` (an ip4 or ip6 TCP address with a port other than 0) cannot be listened on."""
    family = socket.AF_INET if "ip4" in maddr else socket.AF_INET6 if "ip6" in maddr else None
    if family is None or "tcp" not in maddr or maddr["tcp"] == "0":
        return
    host, port = maddr["ip4" if family == socket.AF_INET else "ip6"], int(maddr["tcp"])
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the daemon listens: TIME_WAIT is no obstacle
        try:
            probe.bind((host, port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise NetworkError(f"--host-maddrs {addr}: port {port} is already in use (a unit or another program "
                                   "listens there): give another port, or 0 for any free one") from None  # fmt: skip
            raise NetworkError(f"--host-maddrs {addr}: cannot listen there: {error.strerror}") from None


def identity_peer_id(path: Path) -> str:
    """Base58 peer id of the identity file at ``path``; NetworkError if it is not a libp2p private key."""
    try:
        return PeerID.from_identity(Path(path).read_bytes()).to_base58()
    except OSError as error:
        raise NetworkError(f"cannot read identity file {path}: {error.strerror}") from None
    except Exception:  # protobuf / DER decoding errors
        raise NetworkError(f"identity file {path} is not a libp2p private key (delete it for a new one)") from None


def ensure_identity(path: Path) -> Path:
    """Create a libp2p RSA private key at ``path`` (mode 0600, parent dirs created) unless one exists; return it.

    The key fixes the peer id across restarts. An existing file is checked, never overwritten (NetworkError if it is
    not a valid key). Creation is atomic: a crash leaves no half-written key.
    """
    path = Path(path).expanduser()
    if path.exists():
        identity_peer_id(path)
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        P2P.generate_identity(str(tmp_path))
        os.chmod(tmp_path, 0o600)
        os.replace(tmp_path, path)
    finally:
        tmp_path.unlink(missing_ok=True)
    logger.info("identity created path=%s peer_id=%s", path, identity_peer_id(path))
    return path


@dataclass(frozen=True)
class Identity:
    """A peer's libp2p identity: its key file, the key (which also signs the peer's records) and its peer id.
    ``fresh``: made for one start (no identity file given); it is deleted once the DHT started."""

    path: Path
    key: IdentityKey
    peer_id: str
    fresh: bool = False


def peer_identity(identity_path: str | None) -> Identity:
    """The identity at ``identity_path`` (created if missing, see :func:`ensure_identity`), or a fresh one in a private
    temporary folder. Raises NetworkError for a file that is not an RSA libp2p key."""
    if identity_path is not None:
        path, fresh = ensure_identity(Path(identity_path)), False
    else:
        path, fresh = Path(tempfile.mkdtemp(prefix="p2p-diloco-identity-")) / "identity.key", True
        P2P.generate_identity(str(path))
    try:
        key = load_identity_key(path)
    except MembershipError as error:
        raise NetworkError(str(error)) from None
    return Identity(path, key, peer_id_of(key.get_public_key()), fresh)


def start_dht(
    network: NetworkSection,
    *,
    identity: Identity | None = None,
    record_validators: Iterable = (),
    reachability: Reachability = DIRECT,
) -> hivemind.DHT:
    """Start a DHT node in a forked process and join the swarm through ``network.initial_peers`` (if any), reachable
    as ``reachability`` says (relays.py; a client one in hivemind's client mode).

    The node's identity is ``identity`` (a fresh one is not checked against live peers, and its file is removed once
    the node started), else ``network.identity_path``, else one p2pd makes up. Raises NetworkError for malformed
    addresses, an unusable identity, or when no initial peer answers within ``network.join_timeout_s`` (then the DHT
    process and its p2pd are killed before raising).
    """
    ensure_fork_start_method()
    initial_peers, host_maddrs, announce_maddrs = check_addresses(network)
    if identity is None and network.identity_path:
        identity = peer_identity(network.identity_path)
    identity_path = str(identity.path) if identity is not None else None

    timeout = network.join_timeout_s
    p2p_options = {"announce_maddrs": announce_maddrs or None, **reachability.p2p_options()}
    dht = hivemind.DHT(
        initial_peers=initial_peers or None,
        start=False,
        client_mode=reachability.client_mode,
        record_validators=list(record_validators),
        host_maddrs=host_maddrs,
        identity_path=identity_path,
        check_if_identity_free=not (identity is not None and identity.fresh),
        startup_timeout=timeout,
        **p2p_options,
    )
    started = time.monotonic()
    try:
        dht.run_in_background(await_ready=True, timeout=timeout)
    except BaseException as error:
        _kill_dht(dht)
        if not isinstance(error, Exception):
            raise
        raise _as_network_error(error, network, initial_peers) from error
    finally:
        if identity is not None and identity.fresh:
            shutil.rmtree(identity.path.parent, ignore_errors=True)
    logger.info(
        "dht started peer_id=%s reachability=%s relays=%d initial_peers=%d seconds=%.2f",
        dht.peer_id,
        reachability.mode,
        len(reachability.relays),
        len(initial_peers),
        time.monotonic() - started,
    )
    return dht


def stop_dht(dht: hivemind.DHT) -> None:
    """Shut ``dht`` down gracefully (bounded by its ``shutdown_timeout``), SIGKILL whatever of its process and
    p2pd survived, and remove their hivemind socket files. Safe to call twice."""
    survivors = descendant_pids(dht.pid) if dht.is_alive() else []
    sockets = hivemind_sockets(survivors)
    dht.shutdown()
    for pid in survivors:
        if is_running(pid):
            logger.warning("p2pd outlived its dht pid=%d, killing it", pid)
            kill_process_tree(pid)
    for path in sockets:
        path.unlink(missing_ok=True)


def _kill_dht(dht: hivemind.DHT) -> None:
    """Kill a DHT process that failed to start, with its p2pd; reap it and remove their hivemind socket files."""
    if dht.pid is not None:
        sockets = hivemind_sockets(descendant_pids(dht.pid))
        kill_process_tree(dht.pid)
        dht.join(timeout=5)
        for path in sockets:
            path.unlink(missing_ok=True)


def _as_network_error(error: Exception, network: NetworkSection, initial_peers: list[str]) -> NetworkError:
    text = str(error)
    peers = ", ".join(initial_peers) or "none"
    within = f"within {network.join_timeout_s:g} s (initial peers: {peers})"
    if isinstance(error, TimeoutError):
        return NetworkError(f"could not join the swarm {within}")
    if "failed to connect to bootstrap peers" in text or "none of the initial_peers responded" in text:
        return NetworkError(f"none of the initial peers answered: {peers}")
    if "is already taken" in text:
        return NetworkError(f"identity {network.identity_path} is already used by a live peer: use another file")
    if isinstance(error, P2PDaemonError) and "failed to start in" in text:
        return NetworkError(f"the p2p daemon did not start {within}")
    return NetworkError(f"the DHT failed to start: {text.splitlines()[0] if text else type(error).__name__}")


def visible_multiaddrs(dht: hivemind.DHT, timeout_s: float = 10.0) -> list[str]:
    """Multiaddrs other peers can use to reach ``dht`` (each ends with /p2p/<peer id>). A relayed node announces its
    circuits through public relays only once its slots there are reserved: this waits up to ``timeout_s`` for an
    address, then raises NetworkError."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return [str(maddr) for maddr in dht.get_visible_maddrs(latest=True)]
        except ValueError:  # hivemind's "No multiaddrs found"
            if time.monotonic() > deadline:
                raise NetworkError(f"the p2p daemon announced no address within {timeout_s:g} s") from None
            time.sleep(0.2)


async def _routing_peers(_dht: hivemind.DHT, node: DHTNode) -> int:
    return sum(len(bucket.nodes_to_peer_id) for bucket in node.protocol.routing_table.buckets)


def count_routing_peers(dht: hivemind.DHT) -> int:
    """Number of other DHT servers in the node's routing table (a dead one stays until Kademlia evicts it)."""
    return dht.run_coroutine(_routing_peers)
