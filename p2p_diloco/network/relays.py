"""How other peers reach a unit: directly, through libp2p relays (circuit relay v2), or not at all (client mode).

A unit behind NAT or a firewall reserves a slot on relays (the bootstrap nodes and reachable units: their p2p daemons
serve as relays by default) and announces ``<relay multiaddr>/p2p-circuit`` addresses; a peer that dials one reaches
it through the relay, which carries every byte of that connection both ways. Connections the unit opens itself stay
direct, and libp2p reuses an open connection whichever side opened it.

What hivemind 1.1.12's p2p daemon does, measured in network namespaces, and what this module does about it:

- Given ``trusted_relays``, the daemon still feeds its auto-relay from a peer source (its ``-relayDiscovery`` flag
  defaults to on, and hivemind never passes it), and go-libp2p's auto-relay then waits 3 minutes before reserving
  while it knows fewer than 4 candidate relays: a unit would be unreachable for its first 3 minutes. With
  ``-relayDiscovery=0`` the trusted relays are static relays, reserved within a second. :func:`use_static_relays`
  adds that flag to every daemon started with ``trusted_relays``, at the one place hivemind turns options into flags
  (``P2P._make_process_args``); hivemind has no option for it.
- Auto-relay announces a circuit only through relays with public addresses, and not before its slot is reserved: a
  unit announces its circuits itself (on a private network auto-relay would announce none).
- A relay node's daemon first relays with go-libp2p's default limits (128 KiB each way and 2 minutes per
  connection: a 100 kB message passed, a 300 kB one reset the circuit) until its AutoNAT finds it public (peers it is
  connected to dial it back, to public addresses only: within seconds of the first ones in namespaces); then a
  second relay with the daemon's own limits (4 GiB, 30 minutes per connection) takes over (1 MB messages passed), and
  slots reserved on the first one are lost. So a unit uses only relays that carry a bulk check to it
  (reachability.py) and reserves its slots after they did; a relay node on a private network never qualifies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from hivemind.p2p import P2P
from hivemind.utils.multiaddr import Multiaddr

CIRCUIT = "p2p-circuit"


@dataclass(frozen=True)
class Reachability:
    """``direct``: other peers dial the unit's own addresses. ``relayed``: they dial it through ``relays`` (the
    multiaddrs of relays that confirmed they reach it). ``client``: nobody can dial it; its DHT node and averagers run
    in hivemind's client mode (outbound connections only: it leads no group, reduces no part, serves no state)."""

    mode: Literal["direct", "relayed", "client"]
    relays: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if (self.mode == "relayed") != bool(self.relays):
            raise ValueError(f"a {self.mode} unit with {len(self.relays)} relays")

    @property
    def client_mode(self) -> bool:
        return self.mode == "client"

    def p2p_options(self) -> dict[str, Any]:
        """Options of hivemind's P2P (through ``hivemind.DHT``) for this reachability; a relayed unit's replace any
        announced addresses of its own (they failed the dial-back check). Installs :func:`use_static_relays`."""
        if self.mode != "relayed":
            return {}
        use_static_relays()
        return {
            "use_auto_relay": True,
            "trusted_relays": list(self.relays),
            "force_reachability": "private",
            "announce_maddrs": [circuit_through(relay) for relay in self.relays],
        }


DIRECT = Reachability("direct")
CLIENT = Reachability("client")


def circuit_through(relay: str) -> str:
    """The address a unit announces to be reached through ``relay`` (a relay's multiaddr ending in /p2p/<its id>)."""
    return f"{relay}/{CIRCUIT}"


def relay_candidates(addresses: Sequence[str]) -> list[str]:
    """The addresses that can serve as relays: direct ones (no circuit of their own) ending in /p2p/<peer id>, in
    order, one per peer id."""
    candidates: dict[str, str] = {}
    for address in addresses:
        names = [protocol.name for protocol in Multiaddr(address).protocols()]
        if CIRCUIT not in names and names[-1:] == ["p2p"]:
            candidates.setdefault(Multiaddr(address).value_for_protocol("p2p"), address)
    return list(candidates.values())


def use_static_relays() -> None:
    """Make every p2p daemon hivemind starts with ``trusted_relays`` use them as static relays (see the module
    docstring). Idempotent; forked processes (a DHT's) inherit it."""
    make_args = P2P._make_process_args
    if getattr(make_args, "static_relays", False):
        return

    def with_static_relays(*args: Any, **kwargs: Any) -> list[str]:
        if kwargs.get("trustedRelays"):
            kwargs["relayDiscovery"] = False
        return make_args(*args, **kwargs)

    with_static_relays.static_relays = True  # type: ignore[attr-defined]
    P2P._make_process_args = staticmethod(with_static_relays)
