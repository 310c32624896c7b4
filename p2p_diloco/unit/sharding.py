"""θ sharded over a unit's ranks (``--shard-model``): torch's FSDP2 (``fully_shard``) inside the unit, for models whose
training state does not fit one device.

Each rank holds 1/N of θ, of its gradients and of the AdamW moments (dimension 0 of every parameter split over the
ranks); forward and backward gather each transformer block's weights for the time they run and reduce-scatter the
gradients. The swarm still sees one peer: rank 0 keeps a full fp32 copy of θ on the host, its *mirror*, which its
round engine reads and writes instead of the model. The mirror is brought up to date (gathered from the shards)
before the engine reads it, and written back (scattered into the shards) after the engine wrote it; ranks.py's
commands make the other ranks take part in each transfer.

Every function here is a collective: all ranks call it, in the same order, with the same arguments (rank 0 alone
supplies the values sent); a lost rank makes it raise RuntimeError (ranks.py turns that into RanksLost).

torch's distributed tensor and checkpoint modules are imported by the functions that need them (they add about a
second to the start of every process, and only a sharded unit uses them).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeGuard

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

Tensors = list[torch.Tensor]


def shard_model(model: torch.nn.Module, device: torch.device) -> Tensors:
    """Shard ``model`` (whole on the host, the same weights on every rank) over the ranks, each block of its layer
    list (the largest ``ModuleList``: a transformer's blocks) a unit of its own and the rest with the root; each
    rank's shards move to ``device`` as they are cut (the model must not be moved after: FSDP would then replace
    the parameters that the optimizer holds). Returns a host fp32 copy of the trained parameters taken before
    sharding: rank 0's mirror (the other ranks drop it)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mirror = [param.detach().to(device="cpu", dtype=torch.float32, copy=True)
              for param in model.parameters() if param.requires_grad]  # fmt: skip
    if device.type == "cuda":
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    blocks = max((module for module in model.modules() if isinstance(module, torch.nn.ModuleList)), key=len,
                 default=torch.nn.ModuleList())  # fmt: skip
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return mirror


@torch.no_grad()
def gather_into(params: Sequence[torch.Tensor], indices: Sequence[int], mirror: Sequence[torch.Tensor] | None) -> None:
    """The full values of ``params[i]`` for each ``i`` in ``indices`` into ``mirror[i]`` (rank 0; the others pass
    None and only send their shards)."""
    for index in indices:
        full = _full(params[index])
        if mirror is not None:
            mirror[index].copy_(full)


@torch.no_grad()
def scatter_from(params: Sequence[torch.Tensor], indices: Sequence[int], mirror: Sequence[torch.Tensor] | None) -> None:
    """``mirror[i]`` (rank 0's; the others pass None) into every rank's shard of ``params[i]``, for each ``i`` in
    ``indices``."""
    from torch.distributed.tensor import distribute_tensor

    for index in indices:
        param = params[index]
        full = torch.empty(param.shape, dtype=param.dtype, device=local_shard(param).device)
        if mirror is not None:
            full.copy_(mirror[index])
        torch.distributed.broadcast(full, src=0)
        if _is_sharded(param):
            shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(shard)
        else:  # a parameter left whole (none in a model that fully_shard wrapped at its root)
            param.copy_(full)


def resharded(model: torch.nn.Module) -> None:
    """Free the whole weights that a forward without backward (an eval) left gathered at the root: until then the
    model's parameters are those whole copies, which writes to the shards do not reach. Not a collective."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.reshard()


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's whole state on the host, keyed by parameter name (rank 0's; the others get an empty dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(model, optimizer, options=options)


def load_full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict | None) -> None:
    """Rank 0's ``state`` (from :func:`full_optimizer_state`; the others pass None) into every rank's shards. A state
    without moments (an optimizer that never stepped) leaves the moments empty."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if not _broadcast_flag(bool(state and state.get("state")), model):
        optimizer.state.clear()
        return
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_optimizer_state_dict(model, optimizer, state or {}, options=options)


def _broadcast_flag(value: bool, model: torch.nn.Module) -> bool:
    """Rank 0's ``value`` on every rank."""
    flag = torch.tensor([int(value)], device=local_shard(next(model.parameters())).device)
    torch.distributed.broadcast(flag, src=0)
    return bool(flag.item())


def _is_sharded(tensor: torch.Tensor) -> TypeGuard[DTensor]:
    """Whether ``tensor`` is a DTensor (none exists before torch's distributed tensor module was imported)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def _full(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if _is_sharded(param) else param.detach()


def local_shard(param: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``param`` (a view: writing to it writes to the parameter)."""
    return param.to_local() if _is_sharded(param) else param
