"""Serve and download the swarm's global state (φ, outer momentum, counters) for joiners and stragglers.

Every live learning unit serves its latest consensus state through a hivemind averager that never averages:
it only answers state downloads (``load_state_from_peers``), and donors are tried in order of their outer
round, freshest first. The bootstrap node serves nothing: state always comes from a live unit.

Wire layout of a state: ``[*global_params, *momentum, counters]`` where ``counters`` is a float64 tensor
``[format, inner_step, tokens, *fragment_rounds]`` (one outer round per streaming fragment). A download is
validated before use (tensor count, shapes, dtypes, finite values, sane counters); an invalid or missing state
yields None and a logged reason.

A download serves one publication whole: :class:`_SnapshotAverager` hands hivemind a copy of the state taken under
its tensors' lock, so a publication that lands while a peer streams the state cannot mix two rounds' tensors.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import hivemind
import torch

logger = logging.getLogger(__name__)

STATE_FORMAT = 2.0
# How often the server re-declares itself as a donor in the DHT. hivemind runs each declaration as a task bounded by
# this period and never retrieves its result: a DHT store slower than the period (a contended machine, a large swarm)
# logs "Task exception was never retrieved: TimeoutError". 10 s halves those stores (and their failures) against the
# former 5 s; a new donor is found at most 10 s after its first publication.
DECLARE_STATE_PERIOD_S = 10.0
# hivemind gives up a download when the donor sends no chunk for request_timeout (3 s here) unless
# next_chunk_timeout is set; a donor first copies its whole state (SmolLM2: 1.1 GB) and a busy 2-core machine took
# longer than 3 s for that, so a late SmolLM2 joiner failed every attempt until its join timeout (measured).
STATE_CHUNK_TIMEOUT_S = 30.0


@dataclass
class SwarmState:
    global_params: list[torch.Tensor]
    momentum: list[torch.Tensor]
    fragment_rounds: list[int]
    inner_step: int
    tokens: int

    @property
    def outer_round(self) -> int:
        """The round every fragment reached (the smallest fragment round)."""
        return min(self.fragment_rounds)


class StateService(Protocol):
    """What a learning unit needs of the state server (StateServer; tests/fakes.py has an in-memory one)."""

    def publish(self, state: SwarmState) -> None: ...

    def download(self, timeout_s: float) -> SwarmState | None: ...


class _SnapshotAverager(hivemind.DecentralizedAverager):
    """hivemind's averager whose state downloads stream a copy of its tensors. hivemind's ``get_current_state`` (the
    hook it documents for overriding) returns the live shared buffers, which the averager process then compresses
    tensor by tensor after the lock is released: a publication in between mixed two rounds' tensors (seen in a swarm
    test, a joiner's φ between the donors' φ of rounds 7 and 8)."""

    def get_current_state(self) -> tuple[Any, Sequence[torch.Tensor], Any]:
        with self.get_tensors() as tensors:
            return dict(group_key=self.get_group_bits()), [tensor.clone() for tensor in tensors], self.tensor_infos


class StateServer:
    """Publishes this unit's consensus state to the swarm and downloads other units' states.

    Owns a hivemind averager process; call :meth:`shutdown` to stop it.
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        prefix: str,
        template: Sequence[torch.Tensor],
        fragments: int = 1,
        request_timeout_s: float = 3.0,
    ):
        self._shapes = [tuple(tensor.shape) for tensor in template]
        self._fragments = fragments
        self._averager = _SnapshotAverager(
            averaged_tensors=[torch.zeros(shape) for shape in self._shapes * 2]
            + [torch.zeros(3 + fragments, dtype=torch.float64)],
            dht=dht,
            start=True,
            prefix=prefix,
            target_group_size=2,
            min_group_size=2,
            request_timeout=request_timeout_s,
            next_chunk_timeout=STATE_CHUNK_TIMEOUT_S,
            allow_state_sharing=False,
            declare_state_period=DECLARE_STATE_PERIOD_S,
        )

    def publish(self, state: SwarmState) -> None:
        """Make ``state`` the one served to peers (copied); sharing starts with the first publication.
        Raises ValueError when it has another number of fragment rounds than this server was made for."""
        if len(state.fragment_rounds) != self._fragments:
            raise ValueError(f"expected {self._fragments} fragment rounds, got {len(state.fragment_rounds)}")
        with self._averager.get_tensors() as buffers:
            for buffer, tensor in zip(buffers, [*state.global_params, *state.momentum]):
                buffer.copy_(tensor.detach().to(device="cpu", dtype=torch.float32))
            buffers[-1].copy_(
                torch.tensor(
                    [STATE_FORMAT, state.inner_step, state.tokens, *state.fragment_rounds], dtype=torch.float64
                )
            )
        self._averager.state_sharing_priority = float(state.outer_round)
        self._averager.allow_state_sharing = True

    def download(self, timeout_s: float) -> SwarmState | None:
        """Download the freshest donor's state, or None when no donor answered or its state was invalid."""
        try:
            loaded = self._averager.load_state_from_peers(timeout=timeout_s)
        except Exception as error:  # a failed download is an expected event in a churning swarm
            logger.warning("state download failed: %s", error)
            return None
        if loaded is None:
            return None
        _metadata, tensors = loaded
        try:
            return self._validated(tensors)
        except ValueError as error:
            logger.warning("rejected a downloaded state: %s", error)
            return None

    def _validated(self, tensors: Sequence[torch.Tensor]) -> SwarmState:
        count = len(self._shapes)
        if len(tensors) != 2 * count + 1:
            raise ValueError(f"expected {2 * count + 1} tensors, got {len(tensors)}")
        for index, tensor in enumerate(tensors[:-1]):
            if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.float32:
                raise ValueError(f"tensor {index} is not float32")
            if tuple(tensor.shape) != self._shapes[index % count]:
                raise ValueError(
                    f"tensor {index} has shape {tuple(tensor.shape)}, expected {self._shapes[index % count]}"
                )
            if not torch.isfinite(tensor).all():
                raise ValueError(f"tensor {index} has non-finite values")
        counters = tensors[-1]
        if counters.dtype != torch.float64 or tuple(counters.shape) != (3 + self._fragments,):
            raise ValueError("malformed counters (another state format or number of fragments)")
        format_version, inner_step, tokens, *rounds = (float(value) for value in counters)
        if format_version != STATE_FORMAT:
            raise ValueError(f"unknown state format {format_version}")
        named = [("inner_step", inner_step), ("tokens", tokens), *(("fragment round", value) for value in rounds)]
        for name, value in named:
            if not (math.isfinite(value) and value >= 0 and value == int(value)):
                raise ValueError(f"invalid {name} {value}")
        return SwarmState(
            global_params=[tensor.clone() for tensor in tensors[:count]],
            momentum=[tensor.clone() for tensor in tensors[count : 2 * count]],
            fragment_rounds=[int(value) for value in rounds],
            inner_step=int(inner_step),
            tokens=int(tokens),
        )

    def shutdown(self) -> None:
        """Stop serving. The donor record expires by itself; a joiner that still tries us moves on to the next
        donor. (Switching sharing off first would make the averager write to the DHT while it shuts down.)"""
        self._averager.shutdown()
