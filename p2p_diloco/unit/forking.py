"""Keep the processes hivemind forks (the DHT, every averager, the state server) from holding copies of the unit's
tensors.

A forked child starts with the whole parent's memory, copy-on-write. It never reads θ, the inner optimizer's state,
φ or the momentum (it reads only the shared-memory buffers it averages or serves), but each page the parent rewrites
afterwards (every inner step rewrites θ and the AdamW moments) stays behind in the child as its private copy, and so
do the heap pages the parent had freed before the fork and reuses later (hivemind's ``share_memory_`` frees each
buffer's zero template just before the fork). Measured on SmolLM2-135M before this module: three children held 33
bytes per parameter of private pages, more than the bare training loop's whole memory.

hivemind starts its processes with ``multiprocessing`` (fork) and offers no hook for this, so the narrowest point is
the interpreter's own fork hooks (``os.register_at_fork``): just before every fork the parent hands its freed heap
pages back to the system (glibc ``malloc_trim``), and right after it the child drops its view of the registered
tensors (``madvise(MADV_DONTNEED)`` on their private pages: the child then reads zeros there, and the parent's
memory is untouched). Tensors in shared memory are never dropped: they are what the child works on. Off glibc
Linux both steps are skipped (the copies then stay, as before). :func:`release_freed_memory` trims the heap on
demand (after a round's merge, at exit).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
import os
import threading
from collections.abc import Callable, Iterable, Iterator

import torch

from p2p_diloco.unit.sharding import local_shard

TensorSource = Callable[[], Iterable[torch.Tensor | None]]
MADV_DONTNEED = 4

_sources: dict[int, TensorSource] = {}
_lock = threading.Lock()
_libc: ctypes.CDLL | None = None
_libc_loaded = False
_hooked = False  # the fork hooks are registered


def _glibc() -> ctypes.CDLL | None:
    """glibc, loaded once (None off glibc Linux)."""
    global _libc, _libc_loaded
    if not _libc_loaded:
        _libc, _libc_loaded = _load_libc(), True
    return _libc


def _load_libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None or not hasattr(os, "register_at_fork"):
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    if not hasattr(libc, "malloc_trim"):  # not glibc
        return None
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    return libc


@contextlib.contextmanager
def dropped_in_forked_children(source: TensorSource) -> Iterator[None]:
    """While inside, every process forked from this one drops its copy of the CPU tensors ``source()`` yields (None
    entries are skipped); ``source`` is called in the child right after the fork, so it yields what exists then.
    The child must never read those tensors."""
    global _hooked
    with _lock:
        if not _hooked and _glibc() is not None:
            os.register_at_fork(before=_trim_heap, after_in_child=_drop_sources)
            _hooked = True
        key = id(source)
        _sources[key] = source
    try:
        yield
    finally:
        with _lock:
            _sources.pop(key, None)


def _trim_heap() -> None:
    if _libc is not None and _sources:
        _libc.malloc_trim(0)


def release_freed_memory() -> None:
    """Hand the pages glibc keeps of freed heap memory back to the system (``malloc_trim``; nothing off glibc). A
    round's momentary copies of the model are freed to the heap, where glibc keeps the pages of blocks below its mmap
    threshold (a model's per-parameter tensors): without this a unit's memory crept up by about a copy of the model
    over its first rounds."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def _drop_sources() -> None:
    for source in list(_sources.values()):
        for tensor in source():
            if tensor is not None:
                _drop(tensor)


def _drop(tensor: torch.Tensor) -> None:
    """MADV_DONTNEED on the whole pages inside ``tensor``'s storage, when it is private CPU memory. The first bytes
    after the storage's start are kept (the allocator may keep its bookkeeping there when the block is freed). A
    tensor sharded over ranks drops this rank's shard."""
    tensor = local_shard(tensor)
    if tensor.device.type != "cpu" or tensor.is_shared() or _libc is None:
        return
    storage = tensor.untyped_storage()
    start, size = storage.data_ptr(), storage.nbytes()
    page = mmap.PAGESIZE
    first = (start + 64 + page - 1) // page * page
    last = (start + size) // page * page
    if last > first:
        _libc.madvise(first, last - first, MADV_DONTNEED)


def module_tensors(module: torch.nn.Module) -> Iterator[torch.Tensor | None]:
    """A module's parameters, their gradients and its buffers."""
    for param in module.parameters():
        yield param
        yield param.grad
    yield from module.buffers()


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """The tensors of an optimizer's state (AdamW: the moments)."""
    for state in optimizer.state.values():
        yield from (value for value in state.values() if isinstance(value, torch.Tensor))
