"""Atomic local checkpoints: a process may be killed at any instant without corrupting the last checkpoint.

:func:`atomic_write` (also used for other files of a work directory) writes to a temporary file in the
target's directory, fsyncs it, renames it over the target (``os.replace`` is atomic on POSIX) and fsyncs
the directory. Readers therefore see either the previous file or the new one, never a partial file. One
process writes a given path at a time (a peer owns its work directory); temporary files left by a killed
writer are removed by the next write of the same path.

On disk: ``{"format": CHECKPOINT_FORMAT, "payload": payload}`` written with ``torch.save`` and read
with ``weights_only=True``, so a payload holds only (nested) dicts, lists, tuples, tensors, numbers,
strings, booleans and ``None`` (optimizer ``state_dict()``s qualify).
"""

from __future__ import annotations

import glob
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

from p2p_diloco.errors import UserError, first_line

CHECKPOINT_FORMAT = 1


class CheckpointError(UserError):
    """A checkpoint exists but cannot be used; the message is one line naming the file."""


def save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    """Atomically replace ``path`` with ``payload``; creates the parent directory.

    If this raises or the process dies, ``path`` still holds the previous checkpoint (or is absent).
    """
    atomic_write(path, lambda file: torch.save({"format": CHECKPOINT_FORMAT, "payload": payload}, file))


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Atomically replace ``path`` with the bytes ``write`` writes to the file it is given; creates the parent
    directory. If ``write`` (or the disk) raises, or the process dies, ``path`` still holds its previous content
    (or is absent) and the exception propagates."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftover_temp_files(path)
    handle = tempfile.NamedTemporaryFile(dir=path.parent, prefix=_temp_prefix(path), suffix=".tmp", delete=False)
    try:
        with handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(handle.name, path)
    except BaseException:
        Path(handle.name).unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


def load_checkpoint(path: Path) -> dict[str, Any] | None:
    """The payload saved at ``path``, or None when there is no file.

    Raises :class:`CheckpointError` when the file is truncated, corrupt, holds objects outside the
    weights-only allow-list, or was written in another checkpoint format.
    """
    path = Path(path)
    try:
        stored = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        return None
    except Exception as error:  # torch raises RuntimeError, UnpicklingError, EOFError, ... for bad files
        raise CheckpointError(f"checkpoint {path} is unreadable: {type(error).__name__}: {first_line(error)}") from None
    if not isinstance(stored, dict) or not isinstance(stored.get("payload"), dict):
        raise CheckpointError(f"checkpoint {path} is not a p2p_diloco checkpoint")
    if stored.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"checkpoint {path} has format {stored.get('format')!r}, this version reads format {CHECKPOINT_FORMAT}"
        )
    return stored["payload"]


def _temp_prefix(path: Path) -> str:
    return f".{path.name}."


def _remove_leftover_temp_files(path: Path) -> None:
    for leftover in path.parent.glob(glob.escape(_temp_prefix(path)) + "*.tmp"):
        leftover.unlink(missing_ok=True)


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
