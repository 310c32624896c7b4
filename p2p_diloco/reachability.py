"""Whether other peers can open connections to this unit, and what a unit that cannot (a volunteer behind a home
router or a firewall) does instead.

A dial-back check: the joining unit listens on its own ``--host-maddrs`` with a throwaway libp2p identity, connects out
to its initial peers, and asks each in turn (protocol ``DIAL_BACK_PROTOCOL``) to open a *new* connection to the
addresses it announces. The checker dials from a fresh p2p daemon of its own, so the connection the request arrived on
is not reused (libp2p would reuse it, and every peer would look reachable). Every bootstrap node and every reachable
unit answers these checks.

An unreachable unit joins in hivemind's client mode: its DHT node makes requests but serves none (other peers do not
put it in their routing tables), and its averagers join groups led by reachable units, send their parts to the
reducers and receive the averages, but never lead a group, reduce a part or serve their state. So it trains, averages
and downloads state through outbound connections only, and a group needs at least one reachable unit (two
unreachable units alone never average).

The check's wire format reuses hivemind's protobufs: the request is a ``dht_pb2.FindRequest`` whose ``keys`` are the
UTF-8 multiaddrs to dial, the answer a ``dht_pb2.PingResponse`` whose ``available`` is the verdict.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.proto import dht_pb2
from hivemind.utils.multiaddr import Multiaddr

from p2p_diloco.config import NetworkSection
from p2p_diloco.dht import NetworkError, validate_multiaddrs

logger = logging.getLogger(__name__)

DIAL_BACK_PROTOCOL = "p2p_diloco.reachability.dial_back"
MAX_DIAL_BACK_ADDRESSES = 8
DIAL_BACK_TIMEOUT_S = 10.0
"""How long a checker tries to connect to the asker (a dropped SYN makes a TCP dial wait, not fail)."""
_DIALABLE = ("ip4", "ip6", "dns", "dns4", "dns6")


def dial_back_addresses(remote_id: PeerID, keys: Sequence[bytes]) -> list[str]:
    """The multiaddrs of a dial-back request that a checker will dial: each must be a direct TCP address (no relay
    circuit) of the peer that asked, ending in ``/p2p/<its peer id>``, so that a stranger cannot make checkers open
    connections to a third party. Raises ValueError for anything else or for more than MAX_DIAL_BACK_ADDRESSES."""
    if not keys or len(keys) > MAX_DIAL_BACK_ADDRESSES:
        raise ValueError(f"a dial-back request names 1-{MAX_DIAL_BACK_ADDRESSES} addresses, got {len(keys)}")
    addresses = []
    for key in keys:
        address = key.decode("utf-8")
        try:
            protocols = [protocol.name for protocol in Multiaddr(address).protocols()]
        except Exception as error:  # the multiaddr package raises several types for malformed addresses
            raise ValueError(f"not a multiaddr: {address!r} ({error})") from None
        if len(protocols) != 3 or protocols[0] not in _DIALABLE or protocols[1:] != ["tcp", "p2p"]:
            raise ValueError(f"not a direct TCP address of a peer: {address}")
        if Multiaddr(address).value_for_protocol("p2p") != remote_id.to_base58():
            raise ValueError(f"address {address} is not the asking peer's")
        addresses.append(address)
    return addresses


async def serve_dial_back_checks(_dht: object, node: DHTNode) -> None:
    """Answer dial-back checks from the DHT process (run it with ``dht.run_coroutine``); one dial at a time, the
    others wait. An invalid request gets an error; a failed dial answers ``available=False``."""
    one_at_a_time = asyncio.Lock()

    async def dial_back(request: dht_pb2.FindRequest, context: P2PContext) -> dht_pb2.PingResponse:
        addresses = dial_back_addresses(context.remote_id, list(request.keys))
        async with one_at_a_time:
            available = await _can_dial(addresses)
        logger.debug("dial-back check peer=%s available=%s", context.remote_id, available)
        return dht_pb2.PingResponse(available=available)

    await node.p2p.add_protobuf_handler(DIAL_BACK_PROTOCOL, dial_back, dht_pb2.FindRequest)


async def _can_dial(addresses: list[str]) -> bool:
    """Whether a fresh p2p daemon (no listener, no relays) connects to one of ``addresses`` in time."""
    try:
        probe = await P2P.create(initial_peers=addresses, host_maddrs=[], no_listen=True, use_relay=False,
                                 auto_nat=False, nat_port_map=False, dht_mode="client",
                                 startup_timeout=DIAL_BACK_TIMEOUT_S)  # fmt: skip
    except Exception:  # the daemon exits when it reaches none of its initial peers, or times out
        return False
    await probe.shutdown()
    return True


def joins_as_client(network: NetworkSection) -> bool:
    """Whether this unit joins in client mode: ``--reachability private`` says so, ``public`` says not, ``auto`` (the
    default) asks the initial peers for a dial-back check (a unit with no initial peers starts a swarm and must be
    reachable). When no initial peer answers the check (peers of an older version), the unit assumes it is reachable
    and says so. Raises NetworkError for ``private`` without initial peers."""
    if network.reachability == "public":
        return False
    if not network.initial_peers:
        if network.reachability == "private":
            raise NetworkError(
                "--reachability private needs --initial-peers: the first peer of a swarm must be reachable"
            )
        return False
    if network.reachability == "private":
        logger.info("reachability private: joining as a client (outbound connections only)")
        return True
    reachable = asyncio.run(_dial_back_verdict(network))
    if reachable is None:
        logger.warning("no initial peer answered a reachability check: assuming other peers can connect to this unit "
                       "(pass --reachability private if it is behind NAT or a firewall)")  # fmt: skip
        return False
    if not reachable:
        logger.info("other peers cannot connect to this unit (a dial-back from the initial peers failed): joining as "
                    "a client, which averages and downloads state through reachable units but leads no group and "
                    "serves no state")  # fmt: skip
    else:
        logger.info("reachability check: other peers can connect to this unit")
    return not reachable


async def _dial_back_verdict(network: NetworkSection) -> bool | None:
    """The first initial peer's dial-back verdict on a throwaway listener on ``network.host_maddrs``; None when none
    answers (or none is reached) within the join timeout."""
    initial_peers = validate_multiaddrs(network.initial_peers, "--initial-peers", require_peer_id=True)
    try:
        listener = await P2P.create(
            initial_peers=initial_peers,
            host_maddrs=validate_multiaddrs(network.host_maddrs, "--host-maddrs"),
            announce_maddrs=validate_multiaddrs(network.announce_maddrs, "--announce-maddrs") or None,
            use_relay=False,
            dht_mode="client",
            startup_timeout=network.join_timeout_s,
        )
    except P2PDaemonError as error:  # no initial peer reached: joining will say so
        logger.debug("reachability check: no listener: %s", error)
        return None
    try:
        addresses = [str(maddr) for maddr in await listener.get_visible_maddrs()][:MAX_DIAL_BACK_ADDRESSES]
        request = dht_pb2.FindRequest(keys=[address.encode() for address in addresses])
        checkers = dict.fromkeys(
            PeerID.from_base58(Multiaddr(peer).value_for_protocol("p2p")) for peer in initial_peers
        )
        for checker in checkers:
            call = listener.call_protobuf_handler(checker, DIAL_BACK_PROTOCOL, request, dht_pb2.PingResponse)
            try:
                response = await asyncio.wait_for(call, DIAL_BACK_TIMEOUT_S + network.join_timeout_s)
            except Exception as error:  # a peer without the check, gone, or refusing the request
                logger.debug("reachability check by %s failed: %s", checker, error)
                continue
            return bool(response.available)
        return None
    finally:
        await listener.shutdown()
