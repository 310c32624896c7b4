"""The red team's learning unit: the project's own CLI with one part of what it sends replaced (its round metadata,
the tensors it averages, the averages it returns as a reducer, the state it serves, or its records).

    python bench/red_team.py VARIANT[+VARIANT...] join ...     (the arguments of ``p2p-diloco join``)

Each variant patches the running process only, before the CLI starts: the unit then joins, trains and averages like
any other, and lies where its variants say. Tests (tests/test_red_team.py) and the security benchmark
(bench/security.py) start it with ``Swarm.unit(..., cli=red_team_cli(VARIANT))``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import hivemind
import torch

from p2p_diloco import cli, streaming
from p2p_diloco.config import NetworkSection
from p2p_diloco.network import reducer
from p2p_diloco.network.averaging import OuterAverager
from p2p_diloco.network.dht import ensure_identity, identity_peer_id, peer_identity, start_dht, visible_multiaddrs
from p2p_diloco.network.membership import Admission, load_identity_key
from p2p_diloco.network.records import DonorRecord, PeerProgress, SwarmRecords, record_validators
from p2p_diloco.network.relays import CLIENT
from p2p_diloco.network.state_sync import StateServer, SwarmState
from p2p_diloco.robust import BoundedMean, bounded_mean
from p2p_diloco.trust import MAX_ROUND_LEAD

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

SYBIL_DONORS = 8
"""Identities the donor flood declares as donors (each a DHT client of its own that serves nothing)."""
FORGED_ROUND = 999_999


def _thousandfold_average(*args: Any, **kwargs: Any) -> BoundedMean:
    result = bounded_mean(*args, **kwargs)
    return replace(result, value=1000 * result.value)


def _flip_steps() -> None:
    """Every fragment round this process begins sends its step from the round's reference flipped, of honest length:
    ``2r − p`` for payload ``p`` and reference ``r`` (the payload of a unit that trained nothing since φ), so its
    proposal pulls φ back as far as an honest one pushes it forward. Rounds without a reference are left honest."""
    honest_begin = OuterAverager.begin_round

    @functools.wraps(honest_begin)
    def begin_round(self: OuterAverager, proposal: Sequence[torch.Tensor], *args: Any, **kwargs: Any) -> bool:
        reference = kwargs.get("reference")  # the round engine passes it by name
        if reference is not None:
            proposal = [2 * still - sent for sent, still in zip(proposal, reference)]
        return honest_begin(self, proposal, *args, **kwargs)

    OuterAverager.begin_round = begin_round  # type: ignore[method-assign]


def _reduce_thousandfold() -> None:
    """As a reducer, this process returns 1000 × the average of its slice to every member."""
    reducer.bounded_mean = _thousandfold_average


def _serve_poisoned_state() -> None:
    """Every state this process publishes is random tensors, declared (signed, with their SHA-256) at round 10^6."""
    honest = StateServer.publish

    @functools.wraps(honest)
    def publish(self: StateServer, state: SwarmState) -> None:
        poisoned = SwarmState([torch.randn_like(tensor) for tensor in state.global_params],
                              [torch.randn_like(tensor) for tensor in state.momentum],
                              [10**6] * len(state.fragment_rounds), state.inner_step, state.tokens)  # fmt: skip
        honest(self, poisoned)

    StateServer.publish = publish  # type: ignore[method-assign]


def _serve_forged_state_together() -> None:
    """Every state this process publishes is its φ plus noise drawn from the state's rounds alone, declared two rounds
    ahead of its own (a believable round: within MAX_ROUND_LEAD): two red units on one model serve the same forged
    state, so each corroborates the other's (issue 37, colluding donors)."""
    honest = StateServer.publish

    @functools.wraps(honest)
    def publish(self: StateServer, state: SwarmState) -> None:
        ahead = [outer_round + 2 for outer_round in state.fragment_rounds]
        noise = torch.Generator().manual_seed(sum(ahead))
        forged = [tensor + torch.randn(tensor.shape, generator=noise, dtype=tensor.dtype) for tensor in
                  state.global_params]  # fmt: skip
        honest(self, SwarmState(forged, state.momentum, ahead, state.inner_step, state.tokens))

    StateServer.publish = publish  # type: ignore[method-assign]


def _flood_donor_records() -> None:
    """With every state it publishes, this process declares SYBIL_DONORS other identities (signed by each, so valid
    records) donors of a believable, fresher state: MAX_ROUND_LEAD rounds ahead of its own; none serves anything."""
    honest = StateServer.publish
    sybils: list[SwarmRecords] = []

    @functools.wraps(honest)
    def publish(self: StateServer, state: SwarmState) -> None:
        honest(self, state)
        donors: SwarmRecords = self._donors  # type: ignore[assignment]
        if not sybils:
            sybils.extend(_sybil_records(donors, SYBIL_DONORS))
        fresher = [outer_round + MAX_ROUND_LEAD for outer_round in state.fragment_rounds]
        for sybil in sybils:
            claim = DonorRecord(peer_id=str(sybil.dht.peer_id), state_key=self._prefix, fragment_rounds=fresher,
                                digest="0" * 64)  # fmt: skip
            sybil.publish_donor(claim)

    StateServer.publish = publish  # type: ignore[method-assign]


def _sybil_records(records: SwarmRecords, count: int) -> list[SwarmRecords]:
    """``count`` DHT clients with fresh identities, joined through ``records``' DHT (they stop with this process)."""
    network = NetworkSection(run_id=records.run_id, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                             initial_peers=visible_multiaddrs(records.dht))  # fmt: skip
    sybils = []
    for _ in range(count):
        identity = peer_identity(None)
        validators = record_validators(records.access, identity.key)
        dht = start_dht(network, identity=identity, record_validators=validators, reachability=CLIENT)
        sybils.append(SwarmRecords(dht, records.access, validators))
    return sybils


def _forge_progress_records() -> None:
    """Every progress record this process publishes names another peer of the run, at round FORGED_ROUND."""
    honest = SwarmRecords.publish_progress

    @functools.wraps(honest)
    def publish_progress(self: SwarmRecords, progress: PeerProgress, *args: Any, **kwargs: Any) -> None:
        others = sorted(peer for peer in self.read_progress() if peer != progress.peer_id)
        if others:
            progress = progress.copy(update={"peer_id": others[0], "outer_round": FORGED_ROUND})
        honest(self, progress, *args, **kwargs)

    SwarmRecords.publish_progress = publish_progress  # type: ignore[method-assign]


OTHER_REWRITES: dict[str, Callable[[], None]] = {
    "step-flip": _flip_steps,
    "reducer-x1000": _reduce_thousandfold,
    "state-far-ahead": _serve_poisoned_state,
    "state-forged-together": _serve_forged_state_together,
    "donor-flood": _flood_donor_records,
    "record-forgery": _forge_progress_records,
}

VARIANTS = (*GATHER_REWRITES, *PAYLOAD_REWRITES, *STEP_REWRITES, *WEIGHT_REWRITES, *OTHER_REWRITES)


def red_team_cli(*variants: str) -> list[str]:
    """The program that takes ``join ...`` for a unit lying as each of ``variants`` says."""
    unknown = [variant for variant in variants if variant not in VARIANTS]
    if unknown or not variants:
        raise ValueError(f"unknown red-team variants {unknown!r}" if unknown else "give at least one variant")
    return [sys.executable, str(Path(__file__).resolve()), "+".join(variants)]


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


def _apply(variant: str) -> None:
    if variant in GATHER_REWRITES:
        _rewrite_gathers(GATHER_REWRITES[variant])
    elif variant in PAYLOAD_REWRITES:
        _rewrite_payloads(PAYLOAD_REWRITES[variant])
    elif variant in STEP_REWRITES:
        _rewrite_pseudo_gradients(STEP_REWRITES[variant])
    elif variant in WEIGHT_REWRITES:
        _rewrite_weights(WEIGHT_REWRITES[variant])
    else:
        OTHER_REWRITES[variant]()


if __name__ == "__main__":
    for variant in sys.argv[1].split("+"):
        _apply(variant)
    sys.exit(cli.main(sys.argv[2:]))
