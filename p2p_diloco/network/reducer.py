"""hivemind's all-reduce with a bounded reducer: each unit reduces its slice of a round with :func:`bounded_mean`
(robust.py) instead of the plain weighted mean, checks the averaged slices the other members return, and judges the
members whose parts it had to drop or clip far, or whose averages were implausible; given the round's reference (the
payload of a unit that trained nothing since φ: :class:`RoundReference`), it also measures each member's step against
this unit's own over the slice, which gated.py judges over rounds.

hivemind 1.1.12 has no hook for the reducer's rule: ``AllReduceRunner`` builds a ``TensorPartReducer`` that sums
each sender's part with the weight the sender states. :class:`BoundedAllReduceRunner` replaces that reducer with
:class:`BoundedPartReducer`, which keeps hivemind's ordering, failure and ban logic and changes only how one slice is
combined once every live sender's part arrived. Each averaged part another member returns (as the difference from
what this unit sent it) must have the shape sent, be finite, and have an RMS within OFFENCE_RELATIVE × that of the
slice sent to that member or of the members' payloads for this unit's own slice, whichever is larger (trust.py
``within``); an implausible one is replaced by zeros (this unit keeps its own values of that part, as hivemind does
for a reducer that failed), the others are used. The exchange on the wire is unchanged (no extra bytes); the cost is
buffering one slice of every sender, a median over them and, with a reference, the Gram matrix of the senders' steps
(and one more payload's memory for the reference). An all-reduce that ends with parts missing (a timeout, a
member gone) logs which members did not send their parts or return their averages.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartContainer, TensorPartReducer

from p2p_diloco.robust import BoundedMean, bounded_mean
from p2p_diloco.trust import DIRECTED_STEP_SHARE, OFFENCE_RELATIVE, within

logger = logging.getLogger(__name__)


class RoundReference:
    """Tensors shaped like an averager's payload, in memory shared with its averager process (allocate before the
    process starts), holding the round in flight's reference (the payload of a unit that trained nothing since φ:
    rounds/kinds.py), or marked unset for a round that has none (mix and correction rounds, whose members send φ)."""

    def __init__(self, template: Sequence[torch.Tensor]):
        self.tensors = [torch.zeros_like(tensor, dtype=torch.float32, device="cpu").share_memory_()
                        for tensor in template]  # fmt: skip
        self._set = torch.zeros(1, dtype=torch.uint8).share_memory_()

    def hold(self, reference: Sequence[torch.Tensor] | None) -> None:
        """Hold ``reference`` (shaped like the averaged tensors: ``check_round_request``) for the next round (None: that
        round has none). Call only with no round in flight."""
        if reference is not None:
            for buffer, tensor in zip(self.tensors, reference, strict=True):
                buffer.copy_(tensor.detach())
        self._set.fill_(reference is not None)

    def is_set(self) -> bool:
        return bool(self._set.item())


@dataclass
class SenderVerdict:
    """What one sender's parts went through in one all-reduce, as this unit reduced them. It ``offended`` when a part
    was invalid, when its parts deviated from the medians by more than OFFENCE_RELATIVE × the medians' norm over the
    whole slice (not part by part: a part of zero-initialised parameters has a median near 0 in the first rounds, and
    an honest member that made more steps than the others deviated 160× from it), or when it returned an implausible
    average; a part merely dropped as far is no offence (trust.py). Its ``agreement`` (the cosine of its step with
    this unit's own over the slice, on a round given a reference) is judged over rounds: gated.py."""

    parts: int = 0
    invalid: int = 0
    dropped: int = 0
    clipped: int = 0
    capped: int = 0
    worst_excess: float = 0.0
    deviation_square: float = 0.0  # over its parts: the squared norm of their deviations from the slice's medians
    median_square: float = 0.0  # ... and the squared norm of those medians
    agreement: float | None = None  # the cosine of its step with this unit's over the slice; None: not judged
    implausible_results: int = 0  # averaged parts it returned as a reducer that this unit replaced by its own

    def add(self, result: BoundedMean, row: int) -> None:
        """Count row ``row`` of one part's bounded mean."""
        self.parts += 1
        self.invalid += row in result.invalid
        self.dropped += row in result.invalid or row in result.far
        self.clipped += row in result.clipped
        self.capped += row in result.capped
        self.worst_excess = max(self.worst_excess, result.excess[row])
        self.deviation_square += result.deviation[row] ** 2
        self.median_square += result.center_norm**2

    def add_implausible_result(self) -> None:
        self.implausible_results += 1

    @property
    def relative(self) -> float:
        """The norm of its parts' deviations over the norm of the medians, over the parts it sent."""
        if self.median_square > 0:
            return math.sqrt(self.deviation_square / self.median_square)
        return math.inf if self.deviation_square > 0 else 0.0

    @property
    def offended(self) -> bool:
        return bool(self.invalid or self.implausible_results) or self.relative > OFFENCE_RELATIVE

    def summary(self) -> str:
        """What happened to this member's parts and averages, for a log line."""
        said = []
        if self.parts:
            said.append(f"{self.dropped} of {self.parts} parts dropped, {self.clipped} clipped (worst "
                        f"{self.worst_excess:.1f}x the radius, deviations {self.relative:.2g}x the medians' norm), "
                        f"{self.capped} weights capped")  # fmt: skip
        if self.agreement is not None:
            said.append(f"its step's agreement with this unit's {self.agreement:+.2f}")
        if self.implausible_results:
            said.append(f"{self.implausible_results} of its averages replaced by this unit's own values")
        return "; ".join(said)

    @property
    def noteworthy(self) -> bool:
        """Whether anything of this member's was dropped, clipped, capped or replaced."""
        return bool(self.dropped or self.clipped or self.capped or self.implausible_results)


class BoundedPartReducer(TensorPartReducer):
    """hivemind's reducer of one unit's slice, combining each part with :func:`bounded_mean`; ``verdicts[i]`` says
    what sender ``i``'s parts went through, and ``on_finished(verdicts)`` is called once the reducer is finalized.
    With ``references`` (one per part: the slice of a payload that trained nothing) and ``own_sender`` (this unit's
    index among the senders), each sender's step over the slice is compared with this unit's (``agreement``)."""

    def __init__(
        self,
        part_shapes: Sequence[torch.Size],
        num_senders: int,
        on_finished: Callable[[list[SenderVerdict]], None],
        references: Sequence[torch.Tensor] | None = None,
        own_sender: int | None = None,
    ) -> None:
        if references is not None and [tuple(r.shape) for r in references] != [tuple(s) for s in part_shapes]:
            raise ValueError("a reference per part, shaped like it")
        self.verdicts = [SenderVerdict() for _ in range(num_senders)]
        self._references = references
        self._own_sender = own_sender
        self._gram = torch.zeros(num_senders, num_senders, dtype=torch.float64)  # the parts' step_gram, summed
        self._received: dict[int, tuple[torch.Tensor, float]] = {}
        self._squares = [0.0] * num_senders  # per sender: the sum of squares and count of the values it sent
        self._values = [0] * num_senders
        self._on_finished = on_finished
        super().__init__(part_shapes, num_senders)

    def finalize(self) -> None:
        if not self.finished.is_set():
            super().finalize()
            self._judge_directions()
            self._on_finished(self.verdicts)

    def _judge_directions(self) -> None:
        """Each other sender's agreement with this unit's step over the slice, from their summed step Gram matrix,
        judged where both steps are at least DIRECTED_STEP_SHARE of the median sender's (a unit that trained a few
        steps since its round has a direction of noise, as in a final round at exit)."""
        own, squares = self._own_sender, self._gram.diagonal()
        if own is None or not bool(squares.any()):
            return
        floor = DIRECTED_STEP_SHARE**2 * float(squares.median())
        if float(squares[own]) < floor:
            return
        for sender, verdict in enumerate(self.verdicts):
            if sender != own and float(squares[sender]) >= floor and float(squares[sender]) > 0:
                product = float(squares[sender]) * float(squares[own])
                verdict.agreement = float(self._gram[sender, own]) / math.sqrt(product)

    def reset_accumulators(self) -> None:
        self._received = {}
        super().reset_accumulators()

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        """As hivemind's, but the part is kept (not summed) until every live sender's part of this slice arrived."""
        assert 0 <= sender_index < self.num_senders, "invalid sender index"
        assert 0 <= part_index < self.num_parts, "invalid part index"
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:
            await asyncio.wait({self.current_part_future, asyncio.create_task(self.finished.wait())},
                               return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
            if self.finished.is_set():
                raise AllreduceException(f"attempted to aggregate part in a finalized {self.__class__.__name__}")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned in background")
        assert part_index == self.current_part_index
        current_part_future = self.current_part_future
        if part_index < self.sender_failed_after[sender_index]:
            self._received[sender_index] = (tensor_part, float(weight))
            self._squares[sender_index] += float(tensor_part.double().square().sum())
            self._values[sender_index] += tensor_part.numel()
            self.current_part_accumulated_from += 1
            self.check_current_part_finished()
        return await current_part_future

    def typical_rms(self) -> float:
        """The median over the senders of the RMS of the values each sent for this unit's slice so far (0 before any
        arrived): the scale of the members' payloads, which one sender cannot set."""
        sent = [math.sqrt(square / values) for square, values in zip(self._squares, self._values) if values]
        return statistics.median(sent) if sent else 0.0

    def check_current_part_finished(self) -> None:
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from == self.num_current_senders:
            senders = sorted(self._received)
            if senders:
                reference = self._references[self.current_part_index] if self._references is not None else None
                result = bounded_mean([self._received[i][0] for i in senders], [self._received[i][1] for i in senders],
                                      reference=reference)  # fmt: skip
                if result.step_gram is not None:
                    rows = torch.tensor(senders)
                    self._gram[rows[:, None], rows[None, :]] += result.step_gram
                for row, sender in enumerate(senders):
                    self.verdicts[sender].add(result, row)
                self.current_part_future.set_result(result.value)
            else:
                self.current_part_future.set_result(torch.zeros(self.part_shapes[self.current_part_index]))
            self.reset_accumulators()


class BoundedAllReduceRunner(AllReduceRunner):
    """hivemind's all-reduce runner with :class:`BoundedPartReducer` and checked results; ``on_verdicts`` receives,
    once the all-reduce ended (however it ended), every other member's peer id with its :class:`SenderVerdict`
    (members this unit exchanged nothing with left out)."""

    tensor_part_reducer: TensorPartReducer

    def __init__(
        self,
        *args: Any,
        on_verdicts: Callable[[dict[Any, SenderVerdict]], None],
        reference: Sequence[torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        shapes = tuple(part.shape for part in self.parts_for_local_averaging)
        self.tensor_part_reducer.finished.set()  # hivemind's own reducer goes unused: its __del__ would warn
        self._on_verdicts = on_verdicts
        self._verdicts = {peer: SenderVerdict() for peer in self.ordered_peer_ids if peer != self.peer_id}
        self._sent_rms: dict[int, float] = {}

        def keep(verdicts: list[SenderVerdict]) -> None:
            for peer, verdict in zip(self.sender_peer_ids, verdicts):
                if peer in self._verdicts:
                    verdict.implausible_results = self._verdicts[peer].implausible_results
                    self._verdicts[peer] = verdict

        references = self._own_slice_of(reference) if reference is not None else None
        own = self.sender_peer_ids.index(self.peer_id) if self.peer_id in self.sender_peer_ids else None
        self._own_reducer = BoundedPartReducer(shapes, len(self.sender_peer_ids), keep, references, own)
        self.tensor_part_reducer = self._own_reducer
        register = self.tensor_part_container.register_processed_part

        def register_plausible(peer_index: int, part_index: int, delta: torch.Tensor) -> None:
            peer = self.ordered_peer_ids[peer_index]
            if peer != self.peer_id and not self._plausible(peer_index, part_index, delta):
                self._verdicts[peer].add_implausible_result()
                delta = torch.zeros_like(self._sent_part(peer_index, part_index))
            register(peer_index, part_index, delta)

        self.tensor_part_container.register_processed_part = register_plausible
        self._returned_before_failing: dict[int, int] = {}  # reducer index → averaged parts it had returned
        register_failed = self.tensor_part_container.register_failed_reducer

        def count_then_fill_in(peer_index: int) -> None:  # hivemind fills the rest in with this unit's own values
            returned = self.tensor_part_container._outputs_registered_by_peer[peer_index]
            self._returned_before_failing.setdefault(peer_index, returned)
            register_failed(peer_index)

        self.tensor_part_container.register_failed_reducer = count_then_fill_in

    def _own_slice_of(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The parts of ``tensors`` (shaped like the averaged ones) that make up this unit's slice, split as hivemind
        split the averaged tensors (views, no copy)."""
        container = self.tensor_part_container
        split = TensorPartContainer(tensors, self.peer_fractions, compression=container.compression,
                                    part_size_bytes=container.part_size_bytes,
                                    tensor_infos=container.tensor_infos)  # fmt: skip
        return [part for part, _ in split._input_parts_by_peer[self.ordered_peer_ids.index(self.peer_id)]]

    def _missing_parts(self) -> str:
        """Which members sent this unit fewer parts of its slice than the slice has, and which reducers returned
        fewer averaged parts than this unit sent them (empty when nothing is missing)."""
        container, reducer = self.tensor_part_container, self.tensor_part_reducer
        said = [f"{peer} sent {received} of {reducer.num_parts} parts of this unit's slice"
                for peer, received in zip(self.sender_peer_ids, reducer.num_parts_received)
                if received < reducer.num_parts]  # fmt: skip
        for index, peer in enumerate(self.ordered_peer_ids):
            registered = container._outputs_registered_by_peer[index]  # hivemind's own values fill in for a failure
            returned = self._returned_before_failing.get(index, registered)
            expected = container.num_parts_by_peer[index]
            if peer != self.peer_id and returned < expected:
                said.append(f"{peer} returned {returned} of {expected} averaged parts")
        return "; ".join(said)

    def _sent_part(self, peer_index: int, part_index: int) -> torch.Tensor:
        part: torch.Tensor = self.tensor_part_container._input_parts_by_peer[peer_index][part_index][0]
        return part

    def _plausible(self, peer_index: int, part_index: int, delta: Any) -> bool:
        """Whether a member's averaged part (as a difference from what this unit sent it) can be used: the shape
        sent, finite, an RMS of at most OFFENCE_RELATIVE × the larger of that of the whole slice sent to it and the
        typical RMS of what the members sent for this unit's own slice (any finite one when both are 0). The second:
        a unit that made one warm-up step since its round sent pseudo-gradients far smaller than the others', and the
        honest average another member returned was judged implausible; at exit its settle rounds then shunned that
        member, who left apart (the emulated-WAN benchmark)."""
        sent = self._sent_part(peer_index, part_index)
        if not isinstance(delta, torch.Tensor) or delta.shape != sent.shape or not bool(delta.isfinite().all()):
            return False
        if peer_index not in self._sent_rms:
            slice_parts = self.tensor_part_container._input_parts_by_peer[peer_index]
            squares = sum(float(part.double().square().sum()) for part, _ in slice_parts)
            self._sent_rms[peer_index] = math.sqrt(squares / max(1, sum(part.numel() for part, _ in slice_parts)))
        rms = float(delta.double().square().mean().sqrt()) if delta.numel() else 0.0
        return within(rms, max(self._sent_rms[peer_index], self._own_reducer.typical_rms()), OFFENCE_RELATIVE)

    def finalize(self, *, cancel: bool = False, exception: BaseException | None = None) -> None:
        """hivemind's, then the verdicts go to ``on_verdicts`` (once, however the all-reduce ended); the members whose
        parts or averages did not all arrive are logged by peer id (hivemind logs only a percentage)."""
        first = not self._future.done()
        missing = self._missing_parts() if first else ""
        super().finalize(cancel=cancel, exception=exception)
        if missing:
            logger.warning("all-reduce ended with parts missing: %s", missing)
        if first:
            self._on_verdicts({peer: verdict for peer, verdict in self._verdicts.items()
                               if verdict.parts or verdict.implausible_results})  # fmt: skip
