"""Atomic local checkpoints: a process may be killed at any instant without corrupting the last checkpoint.

:func:`atomic_write` (also used for other files of a work directory) writes to a temporary file in the
target's directory, fsyncs it, renames it over the target (``os.replace`` is atomic on POSIX) and fsyncs
the directory. Readers therefore see either the previous file or the new one, never a partial file. One
process writes a given path at a time (a peer owns its work directory); temporary files left by a killed
writer are removed by the next write of the same path.

On disk: ``{"format": CHECKPOINT_FORMAT, "payload": payload, "sha256": payload_digest(payload)}`` written with
``torch.save`` and read with ``weights_only=True``, so a payload holds only (nested) dicts, lists, tuples, tensors,
numbers, strings, booleans and ``None`` (optimizer ``state_dict()``s qualify). The SHA-256 is checked on load: bytes
changed inside a tensor, which ``torch.load`` does not notice, make the checkpoint unusable rather than wrong (a
checkpoint written before checksums existed loads unchecked).
"""

from __future__ import annotations

import glob
import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

from p2p_diloco.errors import UserError

CHECKPOINT_FORMAT = 1


class CheckpointError(UserError):
    """A checkpoint exists but cannot be used; the message is one line naming the file."""


def save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    """Atomically replace ``path`` with ``payload``; creates the parent directory.

    If this raises or the process dies, ``path`` still holds the previous checkpoint (or is absent).
    """
    stored = {"format": CHECKPOINT_FORMAT, "payload": payload, "sha256": payload_digest(payload)}
    atomic_write(path, lambda file: torch.save(stored, file))


def payload_digest(payload: Any) -> str:
    """SHA-256 over a payload's tensors' bytes and other values, walked in a fixed order (dict keys sorted)."""
    digest = hashlib.sha256()

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            tensor = value.detach().cpu().contiguous()
            digest.update(f"tensor {tensor.dtype} {tuple(tensor.shape)}:".encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().data)
        elif isinstance(value, dict):
            for key in sorted(value, key=repr):
                digest.update(f"key {key!r}:".encode())
                walk(value[key])
        elif isinstance(value, (list, tuple)):
            digest.update(f"{type(value).__name__} {len(value)}:".encode())
            for item in value:
                walk(item)
        else:
            digest.update(f"value {value!r};".encode())

    walk(payload)
    return digest.hexdigest()


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
        # torch's own message advises weights_only=False, which would run code from the file: never repeated here
        raise CheckpointError(
            f"checkpoint {path} is corrupt or truncated ({type(error).__name__}): move it out of the work dir, and the "
            "unit starts from the swarm's state (or its initial weights when it is alone)"
        ) from None
    if not isinstance(stored, dict) or not isinstance(stored.get("payload"), dict):
        raise CheckpointError(f"checkpoint {path} is not a p2p_diloco checkpoint")
    if stored.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"checkpoint {path} has format {stored.get('format')!r}, this version reads format {CHECKPOINT_FORMAT}"
        )
    if "sha256" in stored and stored["sha256"] != payload_digest(stored["payload"]):
        raise CheckpointError(f"checkpoint {path} is corrupt: its content does not match its SHA-256")
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
