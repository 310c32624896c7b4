"""Serve and download the swarm's global state (φ, outer momentum, counters) for joiners and stragglers.

Every live learning unit serves its latest consensus state through a hivemind averager that never averages: it
only answers state downloads, to members of the run (gated.py ``GatedAverager``). After every publication it
declares itself a donor in a signed record (records.py ``DonorRecord``: its fragment rounds and the SHA-256 of the
tensors it serves). The bootstrap node serves nothing: state always comes from a live unit.

A joiner trusts no single donor (:meth:`StateServer.download`):

* a donor whose round is far ahead of the other donors' is not believed (members.py ``believed_rounds``); the
  donors a download failed from (a dead unit's record outlives it by up to DONOR_TTL_S) then count no more, and the
  donors believed without them are tried too;
* the believed donors are tried freshest first, and each download is checked before use: the SHA-256 the donor
  declared (its record is read again when they differ: it may have published a newer state since), then tensor
  count, shapes, dtypes, finite values and sane counters;
* a state is taken once a second donor's download agrees with it (φ within ``CORROBORATION_TOLERANCE`` of each
  other, relative to ‖φ‖, and outer momenta whose norms are within ``MOMENTUM_NORM_RATIO``: without
  ``sync_momentum`` honest momenta differ in direction, not much in size); donors that disagree are outvoted by the next
  ones. A state no other download contradicts is taken alone only when it is the only one that could be downloaded.
  So a joiner downloads twice whenever two donors answer.

Wire layout of a state: ``[*global_params, *momentum, counters]`` where ``counters`` is a float64 tensor
``[format, inner_step, tokens, *fragment_rounds]`` (one outer round per streaming fragment); a unit at outer momentum 0
keeps no momentum and serves ``[*global_params, counters]``; a joiner takes either layout: a unit that
keeps a momentum starts from zeros when the state has none, one that keeps none drops what it got.

A download serves one publication whole: :class:`_SnapshotAverager` hands hivemind a copy of the state taken under
its tensors' lock, so a publication that lands while a peer streams the state cannot mix two rounds' tensors.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import hivemind
import torch
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.streaming import combine_from_streaming

from p2p_diloco.checkpoint import payload_digest
from p2p_diloco.diloco import distance
from p2p_diloco.network.gated import GatedAverager
from p2p_diloco.network.members import believed_rounds
from p2p_diloco.network.membership import MemberGate
from p2p_diloco.network.records import DonorRecord
from p2p_diloco.trust import CORROBORATION_TOLERANCE, MOMENTUM_NORM_RATIO

logger = logging.getLogger(__name__)

STATE_FORMAT = 2.0
# hivemind gives up a download when the donor sends no chunk for request_timeout (3 s here) unless
# next_chunk_timeout is set; a donor first copies its whole state (SmolLM2: 1.1 GB) and a busy 2-core machine took
# longer than 3 s for that, so a late SmolLM2 joiner failed every attempt until its join timeout (measured).
STATE_CHUNK_TIMEOUT_S = 30.0
DONOR_TTL_S = 300.0
STREAM_SLACK_BYTES = 1 << 20  # a download may exceed the state's size by this much (serialization overhead)


@dataclass
class SwarmState:
    global_params: list[torch.Tensor]
    momentum: list[torch.Tensor]
    fragment_rounds: list[int]
    inner_step: int
    tokens: int
    donors: tuple[str, ...] = ()  # the peer ids whose downloads agreed on it (set by StateServer.download)

    @property
    def outer_round(self) -> int:
        """The round every fragment reached (the smallest fragment round)."""
        return min(self.fragment_rounds)


class StateService(Protocol):
    """What a learning unit needs of the state server (StateServer; tests/fakes.py has an in-memory one)."""

    def publish(self, state: SwarmState) -> None: ...

    def download(self, timeout_s: float, refused: frozenset[str] = frozenset()) -> SwarmState | None: ...

    def declared_rounds(self) -> dict[str, int]: ...


class DonorRecords(Protocol):
    """Where donors are declared and found (records.py ``SwarmRecords``)."""

    def publish_donor(self, donor: DonorRecord, ttl_s: float = DONOR_TTL_S) -> None: ...

    def read_donors(self, state_key: str) -> dict[str, DonorRecord]: ...


class _SnapshotAverager(GatedAverager):
    """The gated averager (members only, gated.py) that serves a copy of its tensors and downloads from one
    chosen donor. hivemind's ``get_current_state`` (the hook it documents for overriding) returns the live shared
    buffers, which the averager process then compresses tensor by tensor after the lock is released: a publication in
    between mixed two rounds' tensors (seen in a swarm test, a joiner's φ between the donors' φ of rounds 7 and 8).
    hivemind's own donor declarations (unsigned, anyone may write them) and its download (the first donor that
    answers, whatever it sends) are not used: :class:`StateServer` declares signed records and picks donors."""

    _rpc_handlers = None  # hivemind caches RPC handlers per class: a subclass must collect its own
    _stub_type = None

    def get_current_state(self) -> tuple[Any, Sequence[torch.Tensor], Any]:
        with self.get_tensors() as tensors:
            return dict(group_key=self.get_group_bits()), [tensor.clone() for tensor in tensors], self.tensor_infos

    async def _declare_for_download_periodically(self) -> None:
        return  # donors are declared in signed records (StateServer.publish)

    def fetch_state(self, peer_id: str, max_bytes: int, timeout_s: float) -> list[torch.Tensor]:
        """The tensors ``peer_id`` serves, streamed within ``timeout_s``; raises on failure, on a silent donor and
        on a stream longer than ``max_bytes``."""
        future: MPFuture = MPFuture()
        self._outer_pipe.send(("_fetch_state", [], dict(peer_id=peer_id, max_bytes=max_bytes, future=future)))
        return future.result(timeout=timeout_s)

    async def _fetch_state(self, peer_id: str, max_bytes: int, future: MPFuture) -> None:
        try:
            future.set_result(await self._stream_state(peer_id, max_bytes))
        except BaseException as error:
            future.set_exception(error)
            if not isinstance(error, Exception):
                raise

    async def _stream_state(self, peer_id: str, max_bytes: int) -> list[torch.Tensor]:
        stub = self.get_stub(self._p2p, PeerID.from_base58(peer_id), namespace=self.prefix)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        tensors: list[torch.Tensor] = []
        parts: list[Any] = []
        received = 0
        async for message in aiter_with_timeout(stream, timeout=self.next_chunk_timeout):
            received += len(message.tensor_part.buffer)
            if received > max_bytes:
                raise ValueError(f"the donor streamed over {max_bytes} bytes")
            if message.tensor_part.dtype and parts:
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                parts = []
            parts.append(message.tensor_part)
        if parts:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
        return tensors


class StateServer:
    """Publishes this unit's consensus state to the swarm and downloads other units' states (see the module
    docstring); serves only members of the run when ``gate`` says so (default: everyone). ``donors`` holds the
    signed donor records; ``peer_id`` is this unit's (it never downloads from itself). ``momentum``: whether this
    unit's states carry an outer momentum (the server holds one copy of φ, and of m only then). A unit whose DHT is in
    client mode (unreachable, reachability.py) downloads but serves nothing: its publications are checked, then dropped.

    Owns a hivemind averager process; call :meth:`shutdown` to stop it.
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        prefix: str,
        template: Sequence[torch.Tensor],
        donors: DonorRecords,
        fragments: int = 1,
        request_timeout_s: float = 3.0,
        gate: MemberGate | None = None,
        momentum: bool = True,
    ):
        self._shapes = [tuple(tensor.shape) for tensor in template]
        self._fragments, self._prefix, self._donors = fragments, prefix, donors
        self._peer_id = str(dht.peer_id)
        self._momentum = momentum
        counters = torch.zeros(3 + fragments, dtype=torch.float64)
        buffers = [torch.zeros(shape) for shape in self._shapes * (2 if momentum else 1)] + [counters]
        # a download may carry a momentum whether or not this unit keeps one
        largest = 2 * sum(math.prod(shape) for shape in self._shapes) * 4 + counters.numel() * counters.element_size()
        self._max_bytes = largest + STREAM_SLACK_BYTES
        self._declaring: threading.Thread | None = None
        self._averager = _SnapshotAverager(
            gate=gate if gate is not None else MemberGate.everyone(),
            averaged_tensors=buffers,
            dht=dht,
            start=True,
            prefix=prefix,
            target_group_size=2,
            min_group_size=2,
            request_timeout=request_timeout_s,
            next_chunk_timeout=STATE_CHUNK_TIMEOUT_S,
            allow_state_sharing=False,
        )

    def publish(self, state: SwarmState) -> None:
        """Make ``state`` the one served to peers (copied) and declare this unit a donor of it; sharing starts with
        the first publication. The copy is made before this returns; its SHA-256 and the donor record are made by a
        background thread (hashing a SmolLM2 state takes about 1 s), which the next publication waits for. Until that
        record is out, a joiner that downloads finds the previous record's SHA-256 and moves on to another donor.
        Raises ValueError when it has another number of fragment rounds than this server was made for, or a momentum
        where it was made for none (or none where it was made for one)."""
        if len(state.fragment_rounds) != self._fragments:
            raise ValueError(f"expected {self._fragments} fragment rounds, got {len(state.fragment_rounds)}")
        if len(state.momentum) != (len(self._shapes) if self._momentum else 0):
            raise ValueError(f"a state with {len(state.momentum)} momentum tensors (momentum kept: {self._momentum})")
        if self._averager.client_mode:
            return
        self._wait_for_declaration()
        with self._averager.get_tensors() as buffers:
            for buffer, tensor in zip(buffers, [*state.global_params, *state.momentum]):
                buffer.copy_(tensor.detach().to(device="cpu", dtype=torch.float32))
            buffers[-1].copy_(
                torch.tensor(
                    [STATE_FORMAT, state.inner_step, state.tokens, *state.fragment_rounds], dtype=torch.float64
                )
            )
        self._averager.allow_state_sharing = True
        rounds = list(state.fragment_rounds)
        self._declaring = threading.Thread(target=self._declare, args=(rounds,), name="donor-record", daemon=True)
        self._declaring.start()

    def _declare(self, fragment_rounds: list[int]) -> None:
        with self._averager.get_tensors() as buffers:  # publish() waits for this thread before it writes them again
            digest = payload_digest(list(buffers))
        self._donors.publish_donor(DonorRecord(peer_id=self._peer_id, state_key=self._prefix,
                                               fragment_rounds=fragment_rounds, digest=digest))  # fmt: skip

    def _wait_for_declaration(self) -> None:
        if self._declaring is not None:
            self._declaring.join()

    def download(self, timeout_s: float, refused: frozenset[str] = frozenset()) -> SwarmState | None:
        """A state corroborated by two donors (see the module docstring) within about ``timeout_s``, or None (logged)
        when there is none yet: no believed donor, no valid download, or downloads that disagree. The donors in
        ``refused`` (their state failed the caller's own check) are not asked. The state names the donors whose
        downloads agreed on it (``donors``). Never raises for network failures."""
        deadline = time.monotonic() + timeout_s
        failed: set[str] = set(refused)
        taken: list[tuple[DonorRecord, SwarmState]] = []
        donors = self._believed_donors(failed)
        if not donors:
            logger.info("no donor serves the state yet")
            return None
        tried = {donor.peer_id for donor in donors}
        state = self._corroborated(donors, deadline, taken, failed)
        if state is None and failed:  # e.g. a unit that died (or died while streaming): its record outlives it
            again = [donor for donor in self._believed_donors(failed) if donor.peer_id not in tried]
            state = self._corroborated(again, deadline, taken, failed)
        if state is None and len(taken) == 1:
            logger.warning(
                "state of %s taken uncorroborated: no other donor's could be downloaded", taken[0][0].peer_id
            )
            return replace(taken[0][1], donors=(taken[0][0].peer_id,))
        return state

    def _corroborated(self, donors: list[DonorRecord], deadline: float, taken: list[tuple[DonorRecord, SwarmState]],
                      failed: set[str]) -> SwarmState | None:  # fmt: skip
        """Download from ``donors`` in order until two downloads agree (returns the first of them); the downloads
        that no other one corroborated yet are added to ``taken``, the donors whose download failed or was rejected to
        ``failed``."""
        for donor in donors:
            if time.monotonic() >= deadline:
                break
            state = self._download_from(donor, max(1.0, deadline - time.monotonic()), failed)
            if state is None:
                continue
            for earlier, earlier_state in taken:
                disagreement = _disagreement(earlier_state, state)
                if disagreement is None:
                    logger.info("state of %s corroborated by %s (relative distance of φ %.2e)", earlier.peer_id,
                                donor.peer_id, _relative_gap(earlier_state, state))  # fmt: skip
                    return replace(earlier_state, donors=(earlier.peer_id, donor.peer_id))
                logger.warning("states of %s and %s disagree: %s", earlier.peer_id, donor.peer_id, disagreement)
            taken.append((donor, state))
        return None

    def declared_rounds(self) -> dict[str, int]:
        """The outer round each other unit's donor record declares, by peer id, believed or not (empty when the DHT
        cannot be read). Donors declare every round their state advances: fresher than the progress records."""
        donors = self._donors.read_donors(self._prefix)
        return {peer: donor.outer_round for peer, donor in donors.items() if peer != self._peer_id}

    def _believed_donors(self, failed: set[str]) -> list[DonorRecord]:
        """The other units' donor records whose rounds are believed among those of the donors not known to be
        ``failed``, freshest first (ties in random order). A dead unit's record outlives it (DONOR_TTL_S): it
        no longer holds the live donors' rounds down once a download from it failed (a donor shut down while it
        streams sends a cut-off state, which is rejected: that counts as failed too)."""
        donors = {peer: donor for peer, donor in self._donors.read_donors(self._prefix).items()
                  if peer != self._peer_id and peer not in failed}  # fmt: skip
        believed = believed_rounds({peer: donor.outer_round for peer, donor in donors.items()})
        for peer in donors.keys() - believed.keys():
            logger.warning("donor %s claims outer round %d, far ahead of the others (not believed)", peer,
                           donors[peer].outer_round)  # fmt: skip
        order = sorted(believed, key=lambda peer: (believed[peer], random.random()), reverse=True)
        return [donors[peer] for peer in order]

    def _download_from(self, donor: DonorRecord, timeout_s: float, failed: set[str]) -> SwarmState | None:
        try:
            tensors = self._averager.fetch_state(donor.peer_id, self._max_bytes, timeout_s)
        except Exception as error:  # a failed download is an expected event in a churning swarm
            logger.warning("state download from %s failed: %s", donor.peer_id, error or type(error).__name__)
            failed.add(donor.peer_id)
            return None
        try:
            digest = payload_digest(list(tensors))
            if digest != donor.digest:  # the donor may have published since we read its record: read it again
                donor = self._donors.read_donors(self._prefix).get(donor.peer_id, donor)
            if digest != donor.digest:
                raise ValueError("its SHA-256 differs from the one the donor declared")
            state = self._validated(tensors)
            if state.fragment_rounds != donor.fragment_rounds:
                raise ValueError("its rounds differ from the ones the donor declared")
            return state
        except (ValueError, TypeError) as error:
            logger.warning("rejected the state downloaded from %s: %s", donor.peer_id, error)
            failed.add(donor.peer_id)
            return None

    def _validated(self, tensors: Sequence[torch.Tensor]) -> SwarmState:
        count = len(self._shapes)
        if len(tensors) not in (count + 1, 2 * count + 1):
            raise ValueError(f"expected {count + 1} or {2 * count + 1} tensors, got {len(tensors)}")
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
            momentum=[tensor.clone() for tensor in tensors[count:-1]],
            fragment_rounds=[int(value) for value in rounds],
            inner_step=int(inner_step),
            tokens=int(tokens),
        )

    def shutdown(self) -> None:
        """Stop serving. The donor record expires by itself; a joiner that still tries us moves on to the next
        donor. (Switching sharing off first would make the averager write to the DHT while it shuts down.)"""
        self._wait_for_declaration()
        self._averager.shutdown()


def _disagreement(first: SwarmState, second: SwarmState) -> str | None:
    """Why two downloads do not corroborate each other, or None when they do: φ within CORROBORATION_TOLERANCE and
    outer momenta whose norms are within MOMENTUM_NORM_RATIO of each other (both zero agree)."""
    gap = _relative_gap(first, second)
    if gap > CORROBORATION_TOLERANCE:
        return f"relative distance of φ {gap:.2e}"
    smaller, larger = sorted((_norm(first.momentum), _norm(second.momentum)))
    if larger > MOMENTUM_NORM_RATIO * smaller:
        return f"outer momentum norms {smaller:.3g} and {larger:.3g}"
    return None


def _norm(tensors: Sequence[torch.Tensor]) -> float:
    return math.sqrt(sum(float(tensor.double().pow(2).sum()) for tensor in tensors))


def _relative_gap(first: SwarmState, second: SwarmState) -> float:
    """‖φ_first − φ_second‖ / ‖φ_first‖."""
    return distance(first.global_params, second.global_params) / max(_norm(first.global_params), 1e-30)
