"""A learning unit of several processes (ranks): data parallelism inside the unit, one peer in the swarm.

torch's elastic launcher starts the ranks (``p2p-diloco join --nproc-per-node N`` runs it, or ``torchrun
--nproc-per-node N -m p2p_diloco.cli join ...``); each rank runs the same command and tells from the launcher's
environment (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``) who it is. Each rank takes its device from its local rank
(``cuda:LOCAL_RANK``) and trains a replica of the model wrapped in DistributedDataParallel (NCCL on CUDA, gloo on the
CPU), so after every inner step all ranks hold the same θ and AdamW state; each rank reads its own shard of the data.

Rank 0 alone is the unit's peer in the swarm: its DHT node, averagers, state server, records, checkpoints and
evals; its weight is the tokens of all ranks. The pseudo-gradient of a replicated θ is the same on every rank, so a
single averaging sends each byte once (INTELLECT-1 sharded with FSDP and averaged per shard; for replicated ranks
that would add nothing but N times the connections). Before each inner step rank 0 broadcasts a control word:
stop, θ changed since the last word (a round merged, or θ was reset to φ), AdamW moments reset; when θ changed, θ
follows it. After the unit joined (a download or a checkpoint) rank 0 broadcasts its peer id, θ and the inner
optimizer's state.

Failure contract: a collective that fails (a rank died, or froze past the process group's timeout) raises
:class:`RanksLost` and marks the ranks ``broken``: the unit then leaves without its exit rounds, and the launcher's
restart policy starts every rank again; rank 0 rejoins from the swarm (or its checkpoint) like any restarted unit.
The other units see at most a missed round.
"""

from __future__ import annotations

import inspect
import logging
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
from p2p_diloco.inner import InnerTrainer
from p2p_diloco.lifecycle import launched

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
PROCESS_GROUP_TIMEOUT = timedelta(minutes=10)  # rank 0's longest pause between two steps: a join, an eval, a save


class RanksLost(UserError):
    """A collective between the unit's ranks failed; the launcher restarts the unit."""


@dataclass(frozen=True)
class StepControl:
    """What rank 0 tells the other ranks after a step."""

    stop: bool = False
    theta_changed: bool = False
    moments_reset: bool = False


@dataclass(frozen=True)
class UnitStart:
    """What rank 0 tells the other ranks once the unit joined."""

    peer_id: str
    inner_step: int
    inner_state: dict  # InnerTrainer.state_dict(): AdamW moments, the schedule's position, the loss scaler


@dataclass
class Ranks:
    """This process's place in its unit: one rank (the default) or one of ``world_size``."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    broken: bool = False
    replica: DistributedDataParallel | None = field(default=None, repr=False)

    @property
    def lead(self) -> bool:
        """Whether this rank is the unit's peer in the swarm."""
        return self.rank == 0

    def replicate(self, model: torch.nn.Module, device: torch.device) -> DistributedDataParallel | None:
        """Wrap ``model`` (already on ``device``) for data parallelism over the ranks (a collective: every rank calls
        it once, rank 0's weights then being everyone's); None for a unit of one rank. Buffers are not broadcast at
        each forward, so rank 0 can evaluate alone."""
        if self.world_size == 1:
            return None
        options: dict[str, Any] = {"device_ids": [device.index] if device.type == "cuda" else None}
        # torch 2.13 renamed broadcast_buffers (the old name warns); older releases know only the old one
        renamed = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
        options["forward_sync_buffers" if renamed else "broadcast_buffers"] = False
        self.replica = self.collective(lambda: DistributedDataParallel(model, **options))
        return self.replica

    def share_start(self, params: Sequence[torch.Tensor], start: UnitStart | None = None) -> UnitStart:
        """Rank 0 sends ``start`` and θ (from ``params``), the others receive them (θ written into ``params``);
        returns the start. A unit of one rank returns ``start``."""
        if self.world_size == 1:
            assert start is not None, "a unit of one rank shares its own start"
            return start
        shared: list[Any] = [start if self.lead else None]
        self.collective(lambda: dist.broadcast_object_list(shared, src=0))
        self._broadcast(params)
        return shared[0]

    def share_step(self, params: Sequence[torch.Tensor], control: StepControl = StepControl()) -> StepControl:
        """Rank 0 sends ``control`` (and θ, from ``params``, when it changed); the others receive them (θ written
        into ``params``) and get the control back. A unit of one rank returns ``control``."""
        if self.world_size == 1:
            return control
        device = params[0].device
        word = torch.tensor([control.stop, control.theta_changed, control.moments_reset], dtype=torch.int32,
                            device=device)  # fmt: skip
        self.collective(lambda: dist.broadcast(word, src=0))
        received = StepControl(*(bool(value) for value in word.tolist()))
        if received.theta_changed:
            self._broadcast(params)
        return received

    def close(self) -> None:
        """Leave the process group after the last collective (a broken one is left to the process's exit)."""
        if self.world_size > 1 and dist.is_initialized() and not self.broken:
            dist.destroy_process_group()

    def _broadcast(self, params: Sequence[torch.Tensor]) -> None:
        """Rank 0's ``params`` into everyone's, in place."""

        def send_all() -> None:
            with torch.no_grad():
                for param in params:
                    dist.broadcast(param.data, src=0)

        self.collective(send_all)

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


def join_ranks(device_choice: str) -> Ranks:
    """This process's ranks from the launcher's environment (one rank when not launched or launched alone); a unit of
    several ranks has its process group initialised (NCCL when the ranks train on CUDA, else gloo). Raises
    RanksLost when the group cannot form."""
    if not launched() or int(os.environ["WORLD_SIZE"]) == 1:
        return Ranks()
    ranks = Ranks(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]))
    backend = "nccl" if device_choice != "cpu" and torch.cuda.is_available() else "gloo"
    store = _restart_store(ranks)

    def form_group() -> None:
        dist.init_process_group(backend, store=store, rank=ranks.rank, world_size=ranks.world_size,
                                timeout=PROCESS_GROUP_TIMEOUT)  # fmt: skip

    ranks.collective(form_group)
    logger.info("rank %d of %d (local rank %d, %s)", ranks.rank, ranks.world_size, ranks.local_rank, backend)
    return ranks


def launch_ranks(nproc_per_node: int, max_restarts: int, device_choice: str, argv: Sequence[str]) -> int:
    """Run ``p2p-diloco`` with ``argv`` (a ``join``) as ``nproc_per_node`` ranks under torch's elastic launcher on this
    host, restarting every rank up to ``max_restarts`` times after one failed; returns 0 once all ranks exited 0.
    Raises ConfigError for more CUDA ranks than devices, RanksLost when the unit failed after its last restart."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from p2p_diloco.config import ConfigError

    devices = torch.cuda.device_count() if device_choice != "cpu" and torch.cuda.is_available() else 0
    if devices and nproc_per_node > devices:
        raise ConfigError(f"--nproc-per-node {nproc_per_node} but this host has {devices} CUDA devices")
    arguments = ["--standalone", f"--nproc-per-node={nproc_per_node}", f"--max-restarts={max_restarts}",
                 "-m", "p2p_diloco.cli", *argv]  # fmt: skip
    try:
        run(get_args_parser().parse_args(arguments))
    except ChildFailedError as error:
        rank, failure = error.get_first_failure()
        raise RanksLost(f"the unit failed {max_restarts + 1} times; the last time rank {rank} exited first, with "
                        f"status {failure.exitcode} (its log above says why)") from None  # fmt: skip
    return 0


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


def follow(ranks: Ranks, trainer: InnerTrainer, batches: Iterator[torch.Tensor], first_step: int,
           theta_changed: Callable[[int], None]) -> None:  # fmt: skip
    """A non-lead rank's training loop from the unit's inner step ``first_step``: rank 0's control (θ received in
    place, AdamW moments reset as told, ``theta_changed(the unit's inner step)`` called after a new θ), then a step,
    until rank 0 says stop. Raises RanksLost."""
    steps = first_step
    while True:
        control = ranks.share_step(trainer.params)
        if control.moments_reset:
            trainer.reset_optimizer()
        if control.theta_changed:
            theta_changed(steps)
        if control.stop:
            return
        ranks.collective(lambda: trainer.train_step(batches))
        steps += 1
