"""The red team's learning unit: the project's own CLI with one part of what it sends replaced (its round metadata,
or the tensors it averages).

    python tests/red_team.py VARIANT join ...     (the arguments of ``p2p-diloco join``)

Each variant patches the running process only, before the CLI starts: the unit then joins, trains and averages like
any other, and lies where its variant says. Tests start it with ``Swarm.unit(..., cli=red_team_cli(VARIANT))``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any

import hivemind
import torch

from p2p_diloco import cli
from p2p_diloco.averaging import OuterAverager

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


PayloadRewrite = Callable[[list[torch.Tensor]], list[torch.Tensor]]

PAYLOAD_REWRITES: dict[str, PayloadRewrite] = {
    "payload-x1000": lambda tensors: [tensor * 1000 for tensor in tensors],
}


def red_team_cli(variant: str) -> list[str]:
    """The program that takes ``join ...`` for a unit of ``variant``."""
    if variant not in GATHER_REWRITES and variant not in PAYLOAD_REWRITES:
        raise ValueError(f"unknown red-team variant {variant!r}")
    return [sys.executable, __file__, variant]


def _rewrite_payloads(rewrite: PayloadRewrite) -> None:
    """Every round this process begins (of any kind) averages ``rewrite(payload)`` instead of its payload."""
    honest_begin = OuterAverager.begin_round

    @functools.wraps(honest_begin)
    def begin_round(self: OuterAverager, proposal: Sequence[torch.Tensor], *args: Any, **kwargs: Any) -> bool:
        return honest_begin(self, rewrite([tensor.detach().clone() for tensor in proposal]), *args, **kwargs)

    OuterAverager.begin_round = begin_round  # type: ignore[method-assign]


def _rewrite_gathers(rewrite: GatherRewrite) -> None:
    """Every round this process begins sends ``rewrite(gather)`` to its group instead of its gather."""
    honest_step = hivemind.DecentralizedAverager.step

    @functools.wraps(honest_step)
    def step(self: hivemind.DecentralizedAverager, gather: Any = None, **kwargs: Any) -> Any:
        return honest_step(self, gather=rewrite(gather) if isinstance(gather, dict) else gather, **kwargs)

    hivemind.DecentralizedAverager.step = step  # type: ignore[method-assign]


if __name__ == "__main__":
    if sys.argv[1] in GATHER_REWRITES:
        _rewrite_gathers(GATHER_REWRITES[sys.argv[1]])
    else:
        _rewrite_payloads(PAYLOAD_REWRITES[sys.argv[1]])
    sys.exit(cli.main(sys.argv[2:]))
