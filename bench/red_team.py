"""The red team's learning unit: the project's own CLI with one part of what it sends replaced (its round metadata,
or the tensors it averages).

    python bench/red_team.py VARIANT join ...     (the arguments of ``p2p-diloco join``)

Each variant patches the running process only, before the CLI starts: the unit then joins, trains and averages like
any other, and lies where its variant says. Tests (tests/test_red_team.py) and the security benchmark
(bench/security.py) start it with ``Swarm.unit(..., cli=red_team_cli(VARIANT))``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import hivemind
import torch

from p2p_diloco import cli, streaming
from p2p_diloco.averaging import OuterAverager
from p2p_diloco.dht import ensure_identity, identity_peer_id
from p2p_diloco.membership import Admission, load_identity_key

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
    "payload-noise": lambda tensors: [tensor + torch.randn_like(tensor) for tensor in tensors],
    "payload-nan": lambda tensors: [torch.full_like(tensor, float("nan")) for tensor in tensors],
}

STEP_REWRITES = {
    # its pseudo-gradient Δ = φ − θ flipped and tripled: its outer step pushes φ away from where it trained
    "pseudo-gradient-flip-x3": lambda delta: [-3 * piece for piece in delta],
}

WEIGHT_REWRITES = {
    # it claims 1000 × the tokens it trained on (its weight in every average)
    "weight-x1000": lambda weight: 1000 * weight,
}

VARIANTS = (*GATHER_REWRITES, *PAYLOAD_REWRITES, *STEP_REWRITES, *WEIGHT_REWRITES)


def red_team_cli(variant: str) -> list[str]:
    """The program that takes ``join ...`` for a unit of ``variant``."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown red-team variant {variant!r}")
    return [sys.executable, str(Path(__file__).resolve()), variant]


def admitted_flags(root: Path, name: str, run_id: str, run_key: Path) -> tuple[str, ...]:
    """``--identity-path`` and ``--admission`` of unit ``name`` admitted to ``run_id`` by ``run_key`` (as
    ``p2p-diloco identity`` and ``p2p-diloco admit`` make them), kept in ``root``."""
    identity = ensure_identity(root / f"{name}.key")
    admission = Admission.issue(load_identity_key(run_key), run_id, identity_peer_id(identity))
    (root / f"{name}.admission").write_text(admission.to_text())
    return "--identity-path", str(identity), "--admission", str(root / f"{name}.admission")


def _rewrite_payloads(rewrite: PayloadRewrite) -> None:
    """Every round this process begins (of any kind) averages ``rewrite(payload)`` instead of its payload."""
    honest_begin = OuterAverager.begin_round

    @functools.wraps(honest_begin)
    def begin_round(self: OuterAverager, proposal: Sequence[torch.Tensor], *args: Any, **kwargs: Any) -> bool:
        return honest_begin(self, rewrite([tensor.detach().clone() for tensor in proposal]), *args, **kwargs)

    OuterAverager.begin_round = begin_round  # type: ignore[method-assign]


def _rewrite_weights(rewrite: Callable[[float], float]) -> None:
    """Every round this process begins states ``rewrite(weight)`` as its weight (to hivemind and in its gather)."""
    honest_begin = OuterAverager.begin_round

    @functools.wraps(honest_begin)
    def begin_round(
        self: OuterAverager, proposal: Sequence[torch.Tensor], weight: float, *args: Any, **kwargs: Any
    ) -> bool:
        return honest_begin(self, proposal, rewrite(weight), *args, **kwargs)

    OuterAverager.begin_round = begin_round  # type: ignore[method-assign]


def _rewrite_pseudo_gradients(rewrite: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> None:
    """Every outer step this process proposes is taken on ``rewrite(Δ)`` instead of its pseudo-gradient Δ."""
    honest = streaming.pseudo_gradient

    @functools.wraps(honest)
    def pseudo_gradient(*args: Any, **kwargs: Any) -> list[torch.Tensor]:
        return rewrite(list(honest(*args, **kwargs)))

    streaming.pseudo_gradient = pseudo_gradient


def _rewrite_gathers(rewrite: GatherRewrite) -> None:
    """Every round this process begins sends ``rewrite(gather)`` to its group instead of its gather."""
    honest_step = hivemind.DecentralizedAverager.step

    @functools.wraps(honest_step)
    def step(self: hivemind.DecentralizedAverager, gather: Any = None, **kwargs: Any) -> Any:
        return honest_step(self, gather=rewrite(gather) if isinstance(gather, dict) else gather, **kwargs)

    hivemind.DecentralizedAverager.step = step


if __name__ == "__main__":
    variant = sys.argv[1]
    if variant in GATHER_REWRITES:
        _rewrite_gathers(GATHER_REWRITES[variant])
    elif variant in PAYLOAD_REWRITES:
        _rewrite_payloads(PAYLOAD_REWRITES[variant])
    elif variant in STEP_REWRITES:
        _rewrite_pseudo_gradients(STEP_REWRITES[variant])
    else:
        _rewrite_weights(WEIGHT_REWRITES[variant])
    sys.exit(cli.main(sys.argv[2:]))
