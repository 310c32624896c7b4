"""The red team's learning unit: the project's own CLI with one part of what it sends replaced.

    python tests/red_team.py VARIANT join ...     (the arguments of ``p2p-diloco join``)

Each variant patches the running process only, before the CLI starts: the unit then joins, trains and averages like
any other, and lies where its variant says. Tests start it with ``Swarm.unit(..., cli=red_team_cli(VARIANT))``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import hivemind

from p2p_diloco import cli

GatherRewrite = Callable[[dict[str, Any]], dict[str, Any]]

GATHER_REWRITES: dict[str, GatherRewrite] = {
    # every field of its round metadata out of range or of the wrong type
    "gather-garbage": lambda gather: {
        **gather,
        "outer_round": float("inf"),
        "weight": float("nan"),
        "probe": ["x"] * len(gather["probe"]),
        "tag": ["not", "a", "string"],
        "period": -1.0,
    },
    # a round counter far ahead of everyone's (honest units would jump to it)
    "gather-far-ahead": lambda gather: {**gather, "outer_round": 10**6},
}


def red_team_cli(variant: str) -> list[str]:
    """The program that takes ``join ...`` for a unit of ``variant``."""
    if variant not in GATHER_REWRITES:
        raise ValueError(f"unknown red-team variant {variant!r}")
    return [sys.executable, __file__, variant]


def _rewrite_gathers(rewrite: GatherRewrite) -> None:
    """Every round this process begins sends ``rewrite(gather)`` to its group instead of its gather."""
    honest_step = hivemind.DecentralizedAverager.step

    @functools.wraps(honest_step)
    def step(self: hivemind.DecentralizedAverager, gather: Any = None, **kwargs: Any) -> Any:
        return honest_step(self, gather=rewrite(gather) if isinstance(gather, dict) else gather, **kwargs)

    hivemind.DecentralizedAverager.step = step  # type: ignore[method-assign]


if __name__ == "__main__":
    _rewrite_gathers(GATHER_REWRITES[sys.argv[1]])
    sys.exit(cli.main(sys.argv[2:]))
