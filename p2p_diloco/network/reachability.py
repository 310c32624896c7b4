"""Whether other peers can open connections to this unit, and how a unit that cannot (a volunteer behind a home
router or a firewall) is reached instead: through relays, or not at all (client mode). See relays.py.

A dial-back check: the joining unit listens on its own ``--host-maddrs`` with a throwaway libp2p identity, connects out
to its initial peers, and asks each in turn (protocol ``DIAL_BACK_PROTOCOL``) to open a *new* connection to the
addresses it announces. The checker dials from a fresh p2p daemon of its own, so the connection the request arrived on
is not reused (libp2p would reuse it, and every peer would look reachable). Every bootstrap node and every unit that
can dial out (any but a client) answers these checks.

A unit that fails it checks its relays (default: its initial peers) the same way: a second throwaway listener reserves
a slot on each, and asks each to dial it through its own relay service and send it RELAY_PAYLOAD_BYTES that way. The
relays that do are the ones it announces circuits through (their verdicts are trusted as the dial-back's are); with
none (or with ``--no-use-relays``) it joins as a client: its DHT node makes requests but serves none, and its
averagers join groups led by other units, send their parts to the reducers and receive the averages, but never lead a
group, reduce a part or serve their state.

The check's wire format reuses hivemind's protobufs: the request is a ``dht_pb2.FindRequest`` whose ``keys`` are the
UTF-8 multiaddrs to dial, the answer a ``dht_pb2.PingResponse`` whose ``available`` is the verdict.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.proto import dht_pb2
from hivemind.utils.multiaddr import Multiaddr

from p2p_diloco.config import NetworkSection
from p2p_diloco.network.dht import NetworkError, validate_multiaddrs
from p2p_diloco.network.relays import CIRCUIT, CLIENT, DIRECT, Reachability, circuit_through, relay_candidates

logger = logging.getLogger(__name__)

DIAL_BACK_PROTOCOL = "p2p_diloco.reachability.dial_back"
MAX_DIAL_BACK_ADDRESSES = 8
DIAL_BACK_TIMEOUT_S = 10.0
"""How long a checker tries to connect to the asker (a dropped SYN makes a TCP dial wait, not fail)."""
RELAY_PAYLOAD_PROTOCOL = "p2p_diloco.reachability.relay_payload"
RELAY_PAYLOAD_BYTES = 256 * 1024
"""What a relay check sends through the circuit: twice what a relay of hivemind 1.1.12's p2p daemon carries per
connection before its node is found public (relays.py)."""
RELAY_CHECK_WAIT_S = 30.0
"""How long a unit asks a relay to carry a check through itself: its slot is reserved in the background, and a relay
node relays bulk data only once its AutoNAT found it public (relays.py)."""
_DIALABLE = ("ip4", "ip6", "dns", "dns4", "dns6")


def dial_back_addresses(remote_id: PeerID, keys: Sequence[bytes], checker_id: PeerID) -> list[str]:
    """The multiaddrs of a dial-back request that a checker will dial: each must be the asking peer's, ending in
    ``/p2p/<its peer id>``, and either a direct TCP address or a circuit through the checker itself
    (``<checker's address>/p2p/<checker id>/p2p-circuit/p2p/<asker id>``), so that a stranger cannot make checkers
    open connections to a third party. Raises ValueError for anything else or for more than MAX_DIAL_BACK_ADDRESSES."""
    if not keys or len(keys) > MAX_DIAL_BACK_ADDRESSES:
        raise ValueError(f"a dial-back request names 1-{MAX_DIAL_BACK_ADDRESSES} addresses, got {len(keys)}")
    addresses = []
    for key in keys:
        address = key.decode("utf-8")
        try:
            parts = list(Multiaddr(address).items())
        except Exception as error:  # the multiaddr package raises several types for malformed addresses
            raise ValueError(f"not a multiaddr: {address!r} ({error})") from None
        names = [protocol.name for protocol, _ in parts]
        starts_with_a_peer = len(names) >= 3 and names[0] in _DIALABLE and names[1:3] == ["tcp", "p2p"]
        if not starts_with_a_peer or names[3:] not in ([], [CIRCUIT, "p2p"]):
            raise ValueError(f"not a direct TCP address or a circuit through this checker: {address}")
        if len(names) > 3 and parts[2][1] != checker_id.to_base58():
            raise ValueError(f"address {address} is a circuit through another relay than this checker")
        if parts[-1][1] != remote_id.to_base58():
            raise ValueError(f"address {address} is not the asking peer's")
        addresses.append(address)
    return addresses


async def serve_dial_back_checks(_dht: object, node: DHTNode) -> None:
    """Answer dial-back checks from the DHT process (run it with ``dht.run_coroutine``); one dial at a time, the
    others wait. An invalid request gets an error; a failed dial answers ``available=False``."""
    one_at_a_time = asyncio.Lock()

    async def dial_back(request: dht_pb2.FindRequest, context: P2PContext) -> dht_pb2.PingResponse:
        addresses = dial_back_addresses(context.remote_id, list(request.keys), node.peer_id)
        async with one_at_a_time:
            available = await _can_reach(context.remote_id, addresses)
        logger.debug("dial-back check peer=%s available=%s", context.remote_id, available)
        return dht_pb2.PingResponse(available=available)

    await node.p2p.add_protobuf_handler(DIAL_BACK_PROTOCOL, dial_back, dht_pb2.FindRequest)


async def _can_reach(asker: PeerID, addresses: list[str]) -> bool:
    """Whether a fresh p2p daemon (no listener; relay transport only to dial circuits) connects to one of
    ``addresses`` in time, and, through a circuit, also delivers RELAY_PAYLOAD_BYTES to the asker."""
    through_relay = any(CIRCUIT in address for address in addresses)
    try:
        probe = await P2P.create(
            initial_peers=addresses,
            host_maddrs=[],
            no_listen=True,
            use_relay=through_relay,
            auto_nat=False,
            nat_port_map=False,
            dht_mode="client",
            startup_timeout=DIAL_BACK_TIMEOUT_S,
        )
    except Exception:  # the daemon exits when it reaches none of its initial peers, or times out
        return False
    try:
        if not through_relay:
            return True
        payload = dht_pb2.FindRequest(keys=[bytes(RELAY_PAYLOAD_BYTES)])
        call = probe.call_protobuf_handler(asker, RELAY_PAYLOAD_PROTOCOL, payload, dht_pb2.PingResponse)
        return bool((await asyncio.wait_for(call, DIAL_BACK_TIMEOUT_S)).available)
    except Exception:  # the relay reset the circuit, or the asker did not answer
        return False
    finally:
        await probe.shutdown()


def reachability_of(network: NetworkSection) -> Reachability:
    """How other peers will reach this unit. ``--reachability public``: directly; ``private``: through relays;
    ``auto`` (the default): directly if its initial peers' dial-back check succeeds (a unit with no initial peers
    starts a swarm and must be reachable), else through relays. Through relays means the relays of
    ``network.relays`` (default: the initial peers) that reach it in a relay check; with none, or with
    ``--no-use-relays``, the unit is a client. When no initial peer answers the direct check (peers of an older
    version), the unit assumes it is reachable and says so. Raises NetworkError for ``private`` without initial
    peers."""
    if network.reachability == "public":
        return DIRECT
    if not network.initial_peers:
        if network.reachability == "private":
            raise NetworkError(
                "--reachability private needs --initial-peers: the first peer of a swarm must be reachable"
            )
        return DIRECT
    if network.reachability == "auto":
        reachable = asyncio.run(_direct_verdict(network))
        if reachable is None:
            logger.warning("no initial peer answered a reachability check: assuming other peers can connect to this "
                           "unit (pass --reachability private if it is behind NAT or a firewall)")  # fmt: skip
            return DIRECT
        if reachable:
            logger.info("reachability check: other peers can connect to this unit")
            return DIRECT
        logger.info("other peers cannot connect to this unit (a dial-back from the initial peers failed)")
    if not network.use_relays:
        logger.info("joining as a client (--no-use-relays): outbound connections only, no group led, no state served")
        return CLIENT
    relays = asyncio.run(_confirmed_relays(network))
    if not relays:
        logger.warning("no relay carried a check to this unit: joining as a client, which averages and downloads state "
                       "through other units but leads no group and serves no state")  # fmt: skip
        return CLIENT
    logger.info("other peers reach this unit through %d relay(s): %s", len(relays), " ".join(relays))
    return Reachability("relayed", tuple(relays))


async def _direct_verdict(network: NetworkSection) -> bool | None:
    """The first initial peer's dial-back verdict on a throwaway listener on ``network.host_maddrs``; None when none
    answers (or none is reached) within the join timeout."""
    announced = validate_multiaddrs(network.announce_maddrs, "--announce-maddrs") or None
    listener = await _listener(network, use_relay=False, announce_maddrs=announced)
    if listener is None:
        return None
    try:
        addresses = [str(maddr) for maddr in await listener.get_visible_maddrs()][:MAX_DIAL_BACK_ADDRESSES]
        for checker in dict.fromkeys(_peer_id(peer) for peer in network.initial_peers):
            verdict = await _ask(listener, checker, addresses, DIAL_BACK_TIMEOUT_S + network.join_timeout_s)
            if verdict is not None:
                return verdict
        return None
    finally:
        await listener.shutdown()


async def _confirmed_relays(network: NetworkSection) -> list[str]:
    """The relay candidates (relays.relay_candidates of ``network.relays``, else of the initial peers) that carry a
    check of RELAY_PAYLOAD_BYTES through their own relay service to a throwaway listener; each is asked until it
    confirms or RELAY_CHECK_WAIT_S passed."""
    candidates = relay_candidates(
        validate_multiaddrs(network.relays or network.initial_peers, "--relays", require_peer_id=True)
    )
    if not candidates:
        return []
    listener = await _listener(network, use_relay=True, **Reachability("relayed", tuple(candidates)).p2p_options())
    if listener is None:
        return []
    try:
        await listener.add_protobuf_handler(RELAY_PAYLOAD_PROTOCOL, _payload_received, dht_pb2.FindRequest)
        confirmed = await asyncio.gather(*(_relay_confirms(listener, relay) for relay in candidates))
        return [relay for relay, confirms in zip(candidates, confirmed) if confirms]
    finally:
        await listener.shutdown()


async def _payload_received(request: dht_pb2.FindRequest, _context: P2PContext) -> dht_pb2.PingResponse:
    return dht_pb2.PingResponse(available=sum(len(key) for key in request.keys) >= RELAY_PAYLOAD_BYTES)


async def _relay_confirms(listener: P2P, relay: str) -> bool:
    """Whether ``relay`` carries a relay check to ``listener`` within RELAY_CHECK_WAIT_S (asked once a second)."""
    circuit = f"{circuit_through(relay)}/p2p/{listener.peer_id.to_base58()}"
    deadline = asyncio.get_running_loop().time() + RELAY_CHECK_WAIT_S
    while not await _ask(listener, _peer_id(relay), [circuit], DIAL_BACK_TIMEOUT_S + RELAY_CHECK_WAIT_S):
        if asyncio.get_running_loop().time() > deadline:
            logger.info("relay %s did not carry a %d KiB check to this unit within %g s (a relay needs a public "
                        "address)", relay, RELAY_PAYLOAD_BYTES // 1024, RELAY_CHECK_WAIT_S)  # fmt: skip
            return False
        await asyncio.sleep(1.0)
    return True


async def _listener(network: NetworkSection, **options: Any) -> P2P | None:
    """A throwaway p2p daemon on ``network.host_maddrs`` connected to the initial peers (with hivemind P2P
    ``options``); None when it reaches none of them within the join timeout."""
    try:
        return await P2P.create(
            initial_peers=validate_multiaddrs(network.initial_peers, "--initial-peers", require_peer_id=True),
            host_maddrs=validate_multiaddrs(network.host_maddrs, "--host-maddrs"),
            dht_mode="client",
            startup_timeout=network.join_timeout_s,
            **options,
        )
    except P2PDaemonError as error:  # no initial peer reached: joining will say so
        logger.debug("reachability check: no listener: %s", error)
        return None


async def _ask(listener: P2P, checker: PeerID, addresses: list[str], timeout_s: float) -> bool | None:
    """``checker``'s verdict on dialing ``addresses``; None when it does not answer (no such check, gone, refusing
    the request) within ``timeout_s``."""
    request = dht_pb2.FindRequest(keys=[address.encode() for address in addresses])
    call = listener.call_protobuf_handler(checker, DIAL_BACK_PROTOCOL, request, dht_pb2.PingResponse)
    try:
        response = await asyncio.wait_for(call, timeout_s)
    except Exception as error:  # the check's errors arrive as several exception types
        logger.debug("reachability check by %s failed: %s", checker, error)
        return None
    return bool(response.available)


def _peer_id(address: str) -> PeerID:
    return PeerID.from_base58(Multiaddr(address).value_for_protocol("p2p"))
