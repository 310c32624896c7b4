"""Each node of a chaos run in its own Linux network namespace, all wired to one bridge: a real network that can
partition a single unit (its bridge port goes down: packets are dropped both ways, as on a dead link, while the
unit's own interface stays up). Needs root and iproute2; every namespace it creates is removed by :meth:`close`.

Layout: a switch namespace ``{prefix}sw`` holds bridge ``br0``; node *k* gets namespace ``{prefix}{node}`` with
``eth0`` at ``10.78.0.{k+1}/24``, whose veth peer ``p{k}`` is a port of the bridge. Nothing touches the host's own
network namespace.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess

SUBNET = "10.78.0"


class NamespaceError(RuntimeError):
    """The namespaces could not be created (not root, no iproute2, no kernel support); one line for the user."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class Namespaces:
    """See the module docstring. ``nodes`` are names like "bootstrap", "unit0", ...; creation is idempotent (leftovers
    of an earlier run with the same prefix are removed first)."""

    can_partition = True

    def __init__(self, nodes: list[str], prefix: str = "pdc-"):
        if os.geteuid() != 0 or shutil.which("ip") is None:
            raise NamespaceError("network namespaces need root and iproute2 ('ip'); run without partitions instead")
        if len(nodes) > 250:
            raise NamespaceError("at most 250 nodes fit the /24 subnet")
        self.prefix, self.nodes = prefix, list(nodes)
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
        for index, node in enumerate(self.nodes):
            namespace, port = self._namespace(node), self._port(node)
            _ip("netns", "add", namespace)
            _ip("-n", namespace, "link", "set", "lo", "up")
            _ip("-n", namespace, "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", self.switch)
            _ip("-n", namespace, "addr", "add", f"{SUBNET}.{index + 1}/24", "dev", "eth0")
            _ip("-n", namespace, "link", "set", "eth0", "up")
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")

    def host(self, node: str) -> str:
        return f"{SUBNET}.{self.nodes.index(node) + 1}"

    def wrap(self, node: str, command: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self._namespace(node), *command]

    def cut(self, node: str) -> None:
        _ip("-n", self.switch, "link", "set", self._port(node), "down")

    def restore(self, node: str) -> None:
        _ip("-n", self.switch, "link", "set", self._port(node), "up")

    def close(self) -> None:
        existing = _ip("netns", "list", check=False).stdout.split()
        for namespace in [self.switch, *(self._namespace(node) for node in self.nodes)]:
            if namespace in existing:
                with contextlib.suppress(subprocess.CalledProcessError):
                    _ip("netns", "delete", namespace)
