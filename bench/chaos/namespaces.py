"""Each node of a chaos run in its own Linux network namespace, all wired to one bridge: a real network that can
partition a single unit (its bridge port goes down: packets are dropped both ways, as on a dead link, while the
unit's own interface stays up) and, with ``rate_mbit``, limit every node's link like a WAN uplink. Needs root and
iproute2 (``tc`` too for rate limits); every namespace it creates is removed by :meth:`close`.

Layout: a switch namespace ``{prefix}sw`` holds bridge ``br0``; node *k* gets namespace ``{prefix}{node}`` with
``eth0`` at ``{subnet}.{k+1}/24`` (``10.78.0`` unless the caller picks another /24), whose veth peer ``p{k}`` is a
port of the bridge. A rate limit is a ``tbf`` qdisc on the egress of ``eth0`` (the node's upload) and of ``p{k}``
(its download), so all traffic between nodes crosses two limited links. :meth:`interface_bytes` counts what crossed a
node's link. Nothing touches the host's own network namespace.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess

PRIVATE_SUBNET = "10.78.0"
PUBLIC_SUBNET = "44.78.0"
"""Addresses libp2p takes for public ones: its AutoNAT dials back only public addresses, so only a relay node on them
is found public and relays bulk data (p2p_diloco/network/relays.py). Nothing outside the namespaces routes to them."""

# tbf parameters. The bucket (burst) holds 5 ms of traffic at the rate, which covers a 250 Hz timer tick
# (burst >= rate/HZ), and at least 16 KiB (about 10 full-size frames; a GSO segment larger than the bucket is split by
# tbf into frames, not dropped). The queue (limit) holds 50 ms of traffic at the rate, a WAN-like bottleneck buffer,
# and at least 32 KiB so that TCP on slow links is not starved by tail drops (at 1 Mbit/s a full queue delays packets
# by 260 ms). tbf charges every frame with its headers, so one TCP stream carries about 96% of the rate as payload,
# measured from 1 to 1000 Mbit/s.
_BURST_S = 0.005
_MIN_BURST_BYTES = 16 * 1024
_QUEUE_S = 0.05
_MIN_QUEUE_BYTES = 32 * 1024


class NamespaceError(RuntimeError):
    """The namespaces could not be created (not root, no iproute2, no kernel support); one line for the user."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _tc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["tc", *args], capture_output=True, text=True, check=True)


def tbf_parameters(rate_mbit: float) -> tuple[int, int, int]:
    """``(rate_bit_s, burst_bytes, limit_bytes)`` of the tbf qdisc for ``rate_mbit``; see the comment above."""
    rate_bytes_s = rate_mbit * 1e6 / 8
    burst = max(math.ceil(rate_bytes_s * _BURST_S), _MIN_BURST_BYTES)
    limit = max(math.ceil(rate_bytes_s * _QUEUE_S), _MIN_QUEUE_BYTES)
    return round(rate_mbit * 1e6), burst, limit


class Namespaces:
    """See the module docstring. ``nodes`` are names like "bootstrap", "unit0", ...; creation is idempotent (leftovers
    of an earlier run with the same prefix are removed first). ``rate_mbit`` limits every node's link to that rate in
    each direction (None: unlimited). Raises ValueError for a rate that is not positive and NamespaceError when the
    namespaces or limits cannot be created (nothing is left behind then)."""

    can_partition = True

    def __init__(
        self, nodes: list[str], prefix: str = "pdc-", rate_mbit: float | None = None, subnet: str = PRIVATE_SUBNET
    ):
        if rate_mbit is not None and not (math.isfinite(rate_mbit) and rate_mbit > 0):
            raise ValueError(f"rate_mbit must be a positive number, got {rate_mbit}")
        if os.geteuid() != 0 or shutil.which("ip") is None:
            raise NamespaceError("network namespaces need root and iproute2 ('ip'); run without partitions instead")
        if rate_mbit is not None and shutil.which("tc") is None:
            raise NamespaceError("rate limits need 'tc' (iproute2); install it or run without a rate limit")
        if len(nodes) > 250:
            raise NamespaceError("at most 250 nodes fit the /24 subnet")
        self.prefix, self.nodes, self.rate_mbit, self.subnet = prefix, list(nodes), rate_mbit, subnet
        self.switch = f"{prefix}sw"
        self.close()
        try:
            self._create()
        except subprocess.CalledProcessError as error:
            self.close()
            raise NamespaceError(f"could not create network namespaces: {error.stderr.strip() or error}") from None

    def _namespace(self, node: str) -> str:
        return f"{self.prefix}{node}"

    def _port(self, node: str) -> str:
        return f"p{self.nodes.index(node)}"

    def _create(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for node in self.nodes:
            namespace, port = self._namespace(node), self._port(node)
            _ip("netns", "add", namespace)
            _ip("-n", namespace, "link", "set", "lo", "up")
            _ip("-n", namespace, "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", self.switch)
            _ip("-n", namespace, "addr", "add", f"{self.host(node)}/24", "dev", "eth0")
            _ip("-n", namespace, "link", "set", "eth0", "up")
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            if self.rate_mbit is not None:
                self._limit(namespace, "eth0", self.rate_mbit)
                self._limit(self.switch, port, self.rate_mbit)

    @staticmethod
    def _limit(namespace: str, device: str, rate_mbit: float) -> None:
        rate, burst, limit = tbf_parameters(rate_mbit)
        shape = ["rate", f"{rate}bit", "burst", str(burst), "limit", str(limit)]
        _tc("-n", namespace, "qdisc", "replace", "dev", device, "root", "tbf", *shape)

    def host(self, node: str) -> str:
        return f"{self.subnet}.{self.nodes.index(node) + 1}"

    def wrap(self, node: str, command: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self._namespace(node), *command]

    def cut(self, node: str) -> None:
        _ip("-n", self.switch, "link", "set", self._port(node), "down")

    def restore(self, node: str) -> None:
        _ip("-n", self.switch, "link", "set", self._port(node), "up")

    def drop_inbound(self, node: str) -> None:
        """Firewall ``node`` as a home router does: the connections it opens carry traffic both ways, while every
        connection another node opens to it is dropped (its SYNs go unanswered, so dials time out). Undone by
        :meth:`close`. Raises NamespaceError without iptables (with conntrack) in this system."""
        if shutil.which("iptables") is None:
            raise NamespaceError("dropping inbound connections needs iptables (apt-get install iptables)")
        rules = [["-i", "lo"], ["-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED"]]
        try:
            for rule in rules:
                self._iptables(node, "-A", "INPUT", *rule, "-j", "ACCEPT")
            self._iptables(node, "-A", "INPUT", "-j", "DROP")
        except subprocess.CalledProcessError as error:
            raise NamespaceError(f"could not firewall {node}: {error.stderr.strip() or error}") from None

    def _iptables(self, node: str, *args: str) -> None:
        command = ["ip", "netns", "exec", self._namespace(node), "iptables", *args]
        subprocess.run(command, capture_output=True, text=True, check=True)

    def interface_bytes(self, node: str) -> tuple[int, int]:
        """Cumulative ``(tx_bytes, rx_bytes)`` of ``node``'s ``eth0``: the frames (with headers) that all its processes
        sent and received over its link. A segmentation-offload frame counts its headers once, so bulk TCP counts about
        0-4% above its payload where 1500-byte frames on a wire carry 4.5% of headers. Raises NamespaceError when the
        namespace is gone."""
        try:
            shown = _ip("-n", self._namespace(node), "-s", "-j", "link", "show", "eth0")
        except subprocess.CalledProcessError as error:
            raise NamespaceError(f"no eth0 in namespace of {node}: {error.stderr.strip() or error}") from None
        stats = json.loads(shown.stdout)[0]["stats64"]
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])

    def close(self) -> None:
        existing = _ip("netns", "list", check=False).stdout.split()
        for namespace in [self.switch, *(self._namespace(node) for node in self.nodes)]:
            if namespace in existing:
                with contextlib.suppress(subprocess.CalledProcessError):
                    _ip("netns", "delete", namespace)
