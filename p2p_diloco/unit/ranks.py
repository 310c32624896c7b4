"""A learning unit of several processes (ranks): data parallelism inside the unit, one peer in the swarm.

torch's elastic launcher starts the ranks (``p2p-diloco join --nproc-per-node N`` runs it, or ``torchrun
--nproc-per-node N -m p2p_diloco.cli join ...``); each rank runs the same command and tells from the launcher's
environment (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``) who it is. Each rank takes its device from its local rank
(``cuda:LOCAL_RANK``) and reads its own shard of the data. θ is either *replicated* (the default: each rank trains a
replica wrapped in DistributedDataParallel, so after every inner step all ranks hold the same θ and AdamW state) or
*sharded* (``--shard-model``: FSDP2, each rank holding 1/N of θ, its gradients and AdamW state; sharding.py). NCCL on
CUDA, gloo on the CPU.

Rank 0 alone is the unit's peer in the swarm: its DHT node, averagers, state server, records, checkpoints and
evals; its weight is the tokens of all ranks. The pseudo-gradient of the unit is one tensor set whatever the layout,
so a single averaging sends each byte once (INTELLECT-1 averaged per FSDP shard, which multiplies the connections by
N for the same bytes). Rank 0's round engine works on ``Ranks.theta``: the model's parameters when replicated, a host
mirror of them when sharded.

The other ranks follow rank 0's commands (:class:`Command`, one broadcast word each, then the data it names): train a
step, take rank 0's values of some θ tensors (after a merge or a reset), send their shards of some θ tensors (before
rank 0's engine reads them; sharded only), forget the AdamW moments, evaluate or gather the optimizer state with
rank 0 (sharded only), stop. After the unit joined (a download or a checkpoint) rank 0 broadcasts its peer id, θ
and the inner optimizer's state. Rank 0 says stop after its exit rounds, final eval and checkpoint, which a sharded
unit's ranks all take part in.

Failure contract: a collective that fails (a rank died, or froze past the process group's timeout) raises
:class:`RanksLost` and marks the ranks ``broken``: the unit then leaves without its exit rounds, and the launcher's
restart policy starts every rank again; rank 0 rejoins from the swarm (or its checkpoint) like any restarted unit.
The other units see at most a missed round.
"""

from __future__ import annotations

import enum
import functools
import inspect
import logging
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from p2p_diloco.diloco import consensus_probe, consensus_probe_indices
from p2p_diloco.errors import UserError
from p2p_diloco.lifecycle import launched
from p2p_diloco.unit import sharding
from p2p_diloco.unit.inner import EvalBatch, InnerTrainer

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
PROCESS_GROUP_TIMEOUT = timedelta(minutes=10)  # rank 0's longest pause between two commands: a join, a save
SHARDED_LAYOUT = "sharded"  # the inner state of a checkpoint written by a sharded unit (its moments keyed by name)


class RanksLost(UserError):
    """A collective between the unit's ranks failed; the launcher restarts the unit."""


class Command(enum.IntEnum):
    """What rank 0 tells the other ranks to do next."""

    STEP = 0  # train one inner step
    STOP = 1  # leave: the unit is done
    STORE = 2  # take rank 0's values of the θ tensors named next
    FETCH = 3  # send your shards of the θ tensors named next to rank 0 (sharded)
    RESET_MOMENTS = 4  # forget the AdamW moments
    EVALUATE = 5  # evaluate rank 0's θ replacement with it, on this many eval batches (sharded)
    INNER_STATE = 6  # send your shards of the optimizer state to rank 0 (sharded)


@dataclass(frozen=True)
class UnitStart:
    """What rank 0 tells the other ranks once the unit joined."""

    peer_id: str
    inner_step: int
    inner_state: dict  # InnerTrainer.state_dict(); sharded: without the optimizer's, which travels by its shards


@dataclass
class Ranks:
    """This process's place in its unit: one rank (the default) or one of ``world_size``, replicated or sharded."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    broken: bool = False
    sharded: bool = False
    replica: DistributedDataParallel | None = field(default=None, repr=False)
    mirror: list[torch.Tensor] | None = field(default=None, repr=False)  # rank 0 of a sharded unit: θ on the host
    _model: torch.nn.Module | None = field(default=None, repr=False)
    _stored: bool = False  # θ was stored since the last step
    _resumed_inner: dict | None = field(default=None, repr=False)  # rank 0 of a sharded unit, until the start

    @property
    def lead(self) -> bool:
        """Whether this rank is the unit's peer in the swarm."""
        return self.rank == 0

    @property
    def replicated(self) -> bool:
        """Whether the unit has several ranks, each holding the whole θ."""
        return self.world_size > 1 and not self.sharded

    def prepare(self, model: torch.nn.Module, device: torch.device) -> None:
        """Spread ``model`` (the same weights on every rank) over the ranks (a collective: every rank calls it once):
        sharded, it is sharded and moved to ``device`` (it may still be on the host); replicated, it is wrapped for
        data parallelism (rank 0's weights then being everyone's). Buffers are not broadcast at each forward, so rank 0
        of a replicated unit can evaluate alone. Nothing for a unit of one rank."""
        self._model = model
        if self.sharded:
            mirror = self.collective(lambda: sharding.shard_model(model, device))
            self.mirror = mirror if self.lead else None
        elif self.world_size > 1:
            options: dict[str, Any] = {"device_ids": [device.index] if device.type == "cuda" else None}
            # torch 2.13 renamed broadcast_buffers (the old name warns); older releases know only the old one
            renamed = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
            options["forward_sync_buffers" if renamed else "broadcast_buffers"] = False
            self.replica = self.collective(lambda: DistributedDataParallel(model, **options))

    def theta(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """θ as rank 0's round engine reads and writes it: the mirror of a sharded unit, else ``params``."""
        return self.mirror if self.mirror is not None else list(params)

    # --------------------------------------------------------------------------------- rank 0's commands
    def fetch(self, params: Sequence[torch.Tensor], indices: Sequence[int]) -> None:
        """Bring the mirror's tensors ``indices`` up to date from the shards of ``params`` (nothing when θ is whole
        here)."""
        if self.sharded:
            self._command(Command.FETCH, indices)
            self.collective(lambda: sharding.gather_into(params, indices, self.mirror))

    def store(self, params: Sequence[torch.Tensor], indices: Sequence[int]) -> None:
        """Carry rank 0's θ tensors ``indices`` (the mirror's, or its ``params``) to every rank's ``params``."""
        if self.world_size > 1:
            self._command(Command.STORE, indices)
            self.collective(lambda: self._receive_stored(params, indices))
            self._stored = True

    def step(self) -> bool:
        """Tell the other ranks to train a step; returns whether θ was stored since the last step."""
        if self.world_size > 1:
            self._command(Command.STEP)
        stored, self._stored = self._stored, False
        return stored

    def stop(self) -> None:
        """Tell the other ranks that the unit is done."""
        if self.world_size > 1 and not self.broken:
            self._command(Command.STOP)

    def reset_moments(self, trainer: InnerTrainer) -> None:
        """Every rank forgets its AdamW moments."""
        trainer.reset_optimizer()
        if self.world_size > 1:
            self._command(Command.RESET_MOMENTS)

    def evaluate(self, trainer: InnerTrainer, replacement: Sequence[torch.Tensor], batches: Sequence[EvalBatch]
                 ) -> float:  # fmt: skip
        """The mean loss of θ = ``replacement`` (φ) on ``batches``: rank 0 alone, or all ranks of a sharded unit,
        each on its share of the batches; θ is unchanged after."""
        if not self.sharded:
            with trainer.parameters_swapped(replacement):
                return trainer.evaluate(batches)
        self._command(Command.EVALUATE, range(len(batches)))
        return self.collective(lambda: self._evaluate_shards(trainer, batches, replacement))

    def inner_state(self, trainer: InnerTrainer) -> dict:
        """The inner optimizer's whole state (of every rank's shards when sharded), as a checkpoint keeps it."""
        if not self.sharded:
            return trainer.state_dict()
        self._command(Command.INNER_STATE)
        optimizer = self.collective(lambda: sharding.full_optimizer_state(trainer.model, trainer.optimizer))
        return {**_schedule_state(trainer.state_dict()), "layout": SHARDED_LAYOUT, "optimizer": optimizer}

    def load_inner_state(self, trainer: InnerTrainer, state: dict) -> None:
        """Rank 0: a checkpoint's inner state into ``trainer`` (sharded: at :meth:`share_start`, with the other
        ranks). Moments of a sharded unit are keyed by name, those of the others by position: a state of the other
        layout is dropped with a warning (AdamW starts afresh; the schedule's position is kept)."""
        if (state.get("layout") == SHARDED_LAYOUT) != self.sharded:
            logger.warning("the checkpoint's AdamW moments are of the other --shard-model layout: they start afresh")
            state = {**state, "optimizer": None}
        if self.sharded:
            self._resumed_inner = state
        else:
            trainer.load_state_dict(state)

    def share_start(self, trainer: InnerTrainer, start: UnitStart | None = None) -> UnitStart:
        """Rank 0 sends ``start``, θ (from :meth:`theta`) and the inner optimizer's state, the others receive them
        into their ``trainer``; returns the start. A sharded unit's ranks, rank 0 included, load the state resumed by
        :meth:`load_inner_state` instead of ``start.inner_state`` (fresh when there was none). A unit of one rank
        returns ``start``."""
        if self.world_size == 1:
            assert start is not None, "a unit of one rank shares its own start"
            return start
        sent, resumed = start, self._resumed_inner
        self._resumed_inner = None
        if sent is not None and self.sharded:
            sent = UnitStart(sent.peer_id, sent.inner_step, _schedule_state(resumed or sent.inner_state))
        shared: list[Any] = [sent if self.lead else None]
        self.collective(lambda: dist.broadcast_object_list(shared, src=0))
        received: UnitStart = shared[0]
        self.collective(lambda: self._receive_stored(trainer.params, range(len(trainer.params))))
        if self.sharded:
            optimizer = resumed.get("optimizer") if resumed is not None else None
            load = sharding.load_full_optimizer_state
            self.collective(lambda: load(trainer.model, trainer.optimizer, optimizer))
            trainer.load_state_dict(received.inner_state)  # the schedule's position, the loss scaler
        elif not self.lead:
            trainer.load_state_dict(received.inner_state)
        return received

    def close(self) -> None:
        """Leave the process group after the last collective (a broken one is left to the process's exit)."""
        if self.world_size > 1 and dist.is_initialized() and not self.broken:
            dist.destroy_process_group()

    # ---------------------------------------------------------------------------- the other ranks' side
    def follow(self, trainer: InnerTrainer, batches: Iterator[torch.Tensor], eval_batches: Sequence[torch.Tensor],
               first_step: int, theta_changed: Callable[[int], None]) -> None:  # fmt: skip
        """A rank other than 0: do rank 0's commands from the unit's inner step ``first_step``
        (``theta_changed(the unit's inner step)`` called before the first step after θ was stored), until rank 0
        says stop. Raises RanksLost."""
        steps, stored = first_step, False
        while True:
            command, indices = self._receive_command()
            if command is Command.STOP:
                return
            if command is Command.STEP:
                if stored:
                    theta_changed(steps)
                steps, stored = steps + 1, False
            stored = stored or command is Command.STORE
            self.collective(functools.partial(self._obey, command, indices, trainer, batches, eval_batches))

    def _obey(self, command: Command, indices: list[int], trainer: InnerTrainer, batches: Iterator[torch.Tensor],
              eval_batches: Sequence[torch.Tensor]) -> None:  # fmt: skip
        """A rank other than 0: its part of rank 0's ``command`` (all but STOP)."""
        if command is Command.STEP:
            trainer.train_step(batches)
        elif command is Command.STORE:
            self._receive_stored(trainer.params, indices)
        elif command is Command.FETCH:
            sharding.gather_into(trainer.params, indices, None)
        elif command is Command.RESET_MOMENTS:
            trainer.reset_optimizer()
        elif command is Command.EVALUATE:
            self._evaluate_shards(trainer, [eval_batches[index % len(eval_batches)] for index in indices], None)
        elif command is Command.INNER_STATE:
            sharding.full_optimizer_state(trainer.model, trainer.optimizer)

    # ---------------------------------------------------------------------------------------- transfers
    def _command(self, command: Command, indices: Sequence[int] | range = ()) -> None:
        """Rank 0's ``command`` word and the tensor indices it names, to the other ranks."""
        device = self._device()
        header = torch.tensor([int(command), len(indices)], dtype=torch.int64, device=device)
        self.collective(lambda: dist.broadcast(header, src=0))
        if len(indices):
            named = torch.tensor(list(indices), dtype=torch.int64, device=device)
            self.collective(lambda: dist.broadcast(named, src=0))

    def _receive_command(self) -> tuple[Command, list[int]]:
        device = self._device()
        header = torch.zeros(2, dtype=torch.int64, device=device)
        self.collective(lambda: dist.broadcast(header, src=0))
        command, count = Command(int(header[0])), int(header[1])
        if not count:
            return command, []
        named = torch.zeros(count, dtype=torch.int64, device=device)
        self.collective(lambda: dist.broadcast(named, src=0))
        return command, [int(index) for index in named.tolist()]

    def _receive_stored(self, params: Sequence[torch.Tensor], indices: Sequence[int] | range) -> None:
        """Rank 0's θ tensors ``indices`` into everyone's ``params``, in place."""
        if self.sharded:
            sharding.scatter_from(params, indices, self.mirror)
            return
        with torch.no_grad():
            for index in indices:
                dist.broadcast(params[index].data, src=0)

    def _evaluate_shards(self, trainer: InnerTrainer, batches: Sequence[EvalBatch],
                         replacement: Sequence[torch.Tensor] | None) -> float:  # fmt: skip
        """Sharded: the mean loss of rank 0's ``replacement`` θ over ``batches``, each rank taking every N-th batch
        (padded to the same number of forwards); every rank's shards of θ are put back after."""
        params = trainer.params
        saved = [sharding.local_shard(param).clone() for param in params]
        mine = list(batches[self.rank :: self.world_size])
        forwards = math.ceil(len(batches) / self.world_size)
        try:
            sharding.scatter_from(params, range(len(params)), replacement)
            losses = trainer.batch_losses(mine + [batches[0]] * (forwards - len(mine)))
            total = torch.tensor([sum(losses[: len(mine)]), len(mine)], dtype=torch.float64, device=self._device())
            dist.all_reduce(total)
            return float(total[0] / total[1])
        finally:
            sharding.resharded(trainer.model)
            with torch.no_grad():
                for param, shard in zip(params, saved):
                    sharding.local_shard(param).copy_(shard)

    def _device(self) -> torch.device:
        assert self._model is not None, "the ranks were prepared"
        return sharding.local_shard(next(self._model.parameters())).device

    def collective(self, operation: Callable[[], _T]) -> _T:
        """Run ``operation``, which holds collectives with the other ranks (a DDP step among them); raises RanksLost
        and marks the ranks ``broken`` when it fails."""
        try:
            return operation()
        except RuntimeError as error:  # what gloo and NCCL raise for a lost rank (torch's DistError is one)
            self.broken = True
            raise RanksLost(
                f"rank {self.rank}: a collective with the other ranks of this unit failed: {error}"
            ) from None


@dataclass(frozen=True)
class ThetaLink:
    """Rank 0's round engine's θ (``Ranks.theta``) to and from the ranks' ``params`` (rounds.LocalSync)."""

    ranks: Ranks
    params: Sequence[torch.Tensor]

    def fetch(self, indices: Sequence[int]) -> None:
        self.ranks.fetch(self.params, indices)

    def store(self, indices: Sequence[int]) -> None:
        self.ranks.store(self.params, indices)


def join_ranks(device_choice: str, sharded: bool = False) -> Ranks:
    """This process's ranks from the launcher's environment (one rank when not launched or launched alone), θ
    ``sharded`` over them or replicated; a unit of several ranks has its process group initialised (NCCL when the
    ranks train on CUDA, else gloo). Raises RanksLost when the group cannot form."""
    if not launched() or int(os.environ["WORLD_SIZE"]) == 1:
        return Ranks()
    ranks = Ranks(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]),
                  sharded=sharded)  # fmt: skip
    backend = "nccl" if device_choice != "cpu" and torch.cuda.is_available() else "gloo"
    store = _restart_store(ranks)

    def form_group() -> None:
        dist.init_process_group(backend, store=store, rank=ranks.rank, world_size=ranks.world_size,
                                timeout=PROCESS_GROUP_TIMEOUT)  # fmt: skip

    ranks.collective(form_group)
    logger.info("rank %d of %d (local rank %d, %s)", ranks.rank, ranks.world_size, ranks.local_rank, backend)
    return ranks


def _schedule_state(inner_state: dict) -> dict:
    """An inner state without its optimizer's (which a sharded unit moves by its shards)."""
    return {key: value for key, value in inner_state.items() if key not in ("optimizer", "layout")}


def theta_probe(params: Sequence[torch.Tensor]) -> list[float]:
    """θ at the model's probe coordinates (those of the consensus probes)."""
    return consensus_probe(params, consensus_probe_indices(params))


def _restart_store(ranks: Ranks) -> dist.Store:
    """The launcher's store, under a prefix of its own per restart of the unit. (Measured with torch 2.13's
    ``--standalone`` launcher: after a restart, the ranks that ``init_process_group`` set up from the environment
    alone read the previous incarnation's addresses and failed to connect.)"""
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), ranks.world_size,
                          is_master=ranks.lead and not agent_hosts_it, timeout=PROCESS_GROUP_TIMEOUT)  # fmt: skip
    return dist.PrefixStore(f"p2p-diloco-restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def rank_identity(peer_id: str, rank: int) -> str:
    """The identity a rank's data shard is drawn from: the unit's peer id for rank 0, distinct for the others."""
    return peer_id if rank == 0 else f"{peer_id}/rank{rank}"
