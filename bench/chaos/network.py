"""Where the nodes of a chaos run live on the network: 127.0.0.1 for all of them, or one network namespace each
(``namespaces.py``), which is what makes a real partition of one unit possible."""

from __future__ import annotations

from typing import Protocol


class ChaosNetwork(Protocol):
    can_partition: bool

    def host(self, node: str) -> str:
        """The IPv4 address that ``node`` ("bootstrap" or "unit<i>") listens on and announces."""

    def wrap(self, node: str, command: list[str]) -> list[str]:
        """``command`` made to run inside ``node``'s network (the process keeps the pid of the command)."""

    def cut(self, node: str) -> None:
        """Drop every packet to and from ``node`` until :meth:`restore`."""

    def restore(self, node: str) -> None:
        """Undo :meth:`cut`."""

    def close(self) -> None:
        """Remove whatever was created; idempotent."""


class Loopback:
    """Every node on 127.0.0.1 of this machine's network; partitions are not possible."""

    can_partition = False

    def host(self, node: str) -> str:
        return "127.0.0.1"

    def wrap(self, node: str, command: list[str]) -> list[str]:
        return command

    def cut(self, node: str) -> None:
        raise RuntimeError("partitions need network namespaces (run the chaos harness with --namespaces as root)")

    def restore(self, node: str) -> None:
        raise RuntimeError("partitions need network namespaces")

    def close(self) -> None:
        pass
