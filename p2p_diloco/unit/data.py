"""Packed token batches for training and a fixed held-out evaluation set, from a :class:`DataSection`.

Sources, always read through ``datasets`` as a stream (nothing is cached or copied):

* a local file, glob or directory (searched recursively, hidden entries skipped): ``.txt``/``.md``/``.rst``
  go to the ``text`` builder with ``sample_by="paragraph"`` (a document is a block of text between blank
  lines), ``.json``/``.jsonl`` to ``json``, ``.parquet`` to ``parquet``; files are read in sorted order;
* otherwise a hub dataset name, ``load_dataset(name, dataset_config, split="train", streaming=True)``.

Documents are the non-blank values of ``text_column`` (stripped). A document is held out for evaluation
iff :func:`is_held_out`: a stable hash of its text falls below ``eval_fraction``; the training stream
never contains held-out documents. The evaluation batches are the first ``eval_batches`` batches of the
held-out documents in source order, so they are identical on every peer, whatever its shard seed.

With ``eval_dataset`` (files, or a hub dataset read at ``eval_split``), the evaluation batches are the first
``eval_batches`` batches of its documents instead, and the training stream is every document of ``dataset`` except
those the evaluation read (by their text), so a corpus that overlaps its evaluation set is never trained on it.

Data order: each peer passes its own ``shard_seed`` (the caller derives it from the configured seed and the
peer's identity). Epoch ``e`` of the training stream is ``shuffle(seed=derived(shard_seed, e),
buffer_size=SHUFFLE_BUFFER)``: shard (file) order and documents within a buffer of ``SHUFFLE_BUFFER``
documents are shuffled (a full permutation of corpora smaller than the buffer), differently on every peer
and at every epoch. Documents are tokenized without special tokens, each followed by the tokenizer's eos,
concatenated and cut into rows of ``seq_len`` tokens (no padding; labels = inputs). The training stream is
continuous across epochs.
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import datasets
import torch
import transformers

from p2p_diloco.config import DataSection
from p2p_diloco.errors import UserError, first_line
from p2p_diloco.unit.model import looks_local

logger = logging.getLogger(__name__)
K = TypeVar("K")

SHUFFLE_BUFFER = 10_000
_TOKENIZE_CHUNK = 64
_BUILDERS = {".txt": "text", ".md": "text", ".rst": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
# What datasets raises for unreadable, missing or malformed sources.
_LOAD_ERRORS = (OSError, ValueError, KeyError, ImportError, RuntimeError, datasets.exceptions.DatasetGenerationError)


class DatasetLoadError(UserError):
    """The dataset cannot be loaded or used; the message is one line meant for the user."""


@dataclass
class TextData:
    """Training and evaluation batches: ``torch.long`` tensors of token ids, ``[batch_size, seq_len]``.

    ``eval_batches`` holds at least one batch, all of ``batch_size`` rows (a remainder is dropped), except
    when the held-out documents give fewer rows than that: then it is one smaller batch.
    """

    eval_batches: list[torch.Tensor]
    section: DataSection
    tokenizer: transformers.PreTrainedTokenizerBase = field(repr=False)
    documents: datasets.IterableDataset = field(repr=False)
    shard_seed: int = 0
    evaluated: frozenset[bytes] = field(default=frozenset(), repr=False)  # digests of the eval dataset's documents read

    def train_batches(self, start: DataPosition | None = None) -> TrainingStream:
        """Infinite stream of full training batches from ``start`` (default: epoch 0 of this peer's order).

        Raises DatasetLoadError if an epoch yields no training document.
        """
        return TrainingStream(self, start or DataPosition())

    def _training_texts(self, start: DataPosition) -> Iterator[tuple[DataPosition, str]]:
        """Training documents from ``start``, epoch after epoch, each epoch in its own shuffled order; each with the
        position just after it."""
        for epoch in itertools.count(start.epoch):
            shuffled = self.documents.shuffle(seed=_epoch_seed(self.shard_seed, epoch), buffer_size=SHUFFLE_BUFFER)
            skip = start.documents if epoch == start.epoch else 0
            count = 0
            for text in _texts(shuffled, self.section, _training_filter(self.section, self.evaluated)):
                count += 1
                if count > skip:
                    yield DataPosition(epoch, count), text
            if count == 0:
                raise DatasetLoadError(f"dataset '{self.section.dataset}' has no training documents")
            logger.debug("training epoch done: epoch=%d documents=%d", epoch, count)


@dataclass(frozen=True)
class DataPosition:
    """Where a training stream is: ``documents`` training documents of epoch ``epoch`` were (at least partly)
    trained on. A stream started there skips them without tokenizing them."""

    epoch: int = 0
    documents: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "documents": self.documents}

    @classmethod
    def from_dict(cls, value: object) -> DataPosition:
        """Raises ValueError unless ``value`` is a mapping of two non-negative integers."""
        if not isinstance(value, dict) or set(value) != {"epoch", "documents"}:
            raise ValueError(f"not a data position: {value!r}")
        epoch, documents = value["epoch"], value["documents"]
        if not all(type(number) is int and number >= 0 for number in (epoch, documents)):
            raise ValueError(f"not a data position: {value!r}")
        return cls(epoch, documents)


class TrainingStream(Iterator[torch.Tensor]):
    """The training batches of :meth:`TextData.train_batches`; :attr:`position` is where a stream resumed after the
    last batch taken would start: past every document that batch drew tokens from (the rest of a document cut by
    the batch's end is skipped, never trained on twice)."""

    def __init__(self, data: TextData, start: DataPosition):
        self.position = start
        rows = _pack(_token_ids(data._training_texts(start), data.tokenizer), data.section.seq_len)
        self._batches = _batches(self._tracked(rows), data.section.batch_size, keep_partial=False)

    def _tracked(self, rows: Iterator[tuple[list[int], DataPosition]]) -> Iterator[list[int]]:
        for row, position in rows:
            self.position = position  # a batch is yielded right after its last row is taken
            yield row

    def __next__(self) -> torch.Tensor:
        return next(self._batches)


def is_held_out(text: str, eval_fraction: float) -> bool:
    """True iff the document belongs to the evaluation set (a stable blake2b hash of its text)."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") < eval_fraction * 2**64


def shard_seed(seed: int, identity: str) -> int:
    """Seed of a unit's data order: distinct per identity (e.g. a peer id), reproducible for one identity and seed."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{identity}".encode()).digest()[:8], "little")


def load_text_data(section: DataSection, tokenizer: transformers.PreTrainedTokenizerBase, shard_seed: int) -> TextData:
    """Open the dataset, build the evaluation batches and check that training documents exist.

    Raises DatasetLoadError (one line) for a missing path, an unsupported or mixed file type, a hub dataset
    that cannot be loaded, a missing text column, unreadable data, no held-out sequence or no training data.
    """
    if tokenizer.eos_token_id is None:
        raise DatasetLoadError("the tokenizer has no eos token to separate documents")
    started = time.perf_counter()
    documents = _open(section.dataset, section.dataset_config, "train")
    try:
        eval_batches, evaluated = _evaluation(documents, section, tokenizer)
        has_training = next(_texts(documents, section, _training_filter(section, evaluated)), None) is not None
    except DatasetLoadError:
        raise
    except _LOAD_ERRORS as error:
        raise DatasetLoadError(f"dataset '{section.dataset}' could not be read: {first_line(error)}") from error
    if not eval_batches and section.eval_dataset is not None:
        raise DatasetLoadError(f"eval dataset '{section.eval_dataset}' has no sequence of {section.seq_len} tokens")
    if not eval_batches:
        raise DatasetLoadError(
            f"dataset '{section.dataset}' has no held-out sequence of {section.seq_len} tokens "
            f"(raise --eval-fraction or use a larger corpus)"
        )
    if not has_training:
        raise DatasetLoadError(f"dataset '{section.dataset}' has no training documents")
    logger.info(
        "data ready: dataset=%s eval_batches=%d eval_tokens=%d seconds=%.2f",
        section.dataset,
        len(eval_batches),
        sum(batch.numel() for batch in eval_batches),
        time.perf_counter() - started,
    )
    return TextData(
        eval_batches=eval_batches,
        section=section,
        tokenizer=tokenizer,
        documents=documents,
        shard_seed=shard_seed,
        evaluated=evaluated,
    )


def check_sources(section: DataSection) -> None:
    """Open the training source and the eval source, reading no document, so that a missing path, an unsupported or
    mixed file type or a hub dataset that cannot be resolved is reported before a unit starts anything. Raises
    DatasetLoadError."""
    _open(section.dataset, section.dataset_config, "train")
    if section.eval_dataset is not None:
        _open(section.eval_dataset, section.dataset_config, section.eval_split)


def _evaluation(
    documents: datasets.IterableDataset, section: DataSection, tokenizer: transformers.PreTrainedTokenizerBase
) -> tuple[list[torch.Tensor], frozenset[bytes]]:
    """The evaluation batches, and the digests of the eval dataset's documents they read (empty without one)."""
    if section.eval_dataset is None:
        held_out = _texts(documents, section, lambda text: is_held_out(text, section.eval_fraction))
        return _eval_batches(held_out, section, tokenizer), frozenset()
    source = _open(section.eval_dataset, section.dataset_config, section.eval_split)
    evaluated: set[bytes] = set()
    texts = _recording(_texts(source, section, lambda text: True, section.eval_dataset), evaluated)
    return _eval_batches(texts, section, tokenizer), frozenset(evaluated)


def _recording(texts: Iterator[str], digests: set[bytes]) -> Iterator[str]:
    """``texts``, adding the digest of each one read to ``digests``."""
    for text in texts:
        digests.add(_digest(text))
        yield text


def _eval_batches(
    texts: Iterator[str], section: DataSection, tokenizer: transformers.PreTrainedTokenizerBase
) -> list[torch.Tensor]:
    """Full batches of the first rows of ``texts``; one smaller batch when there are fewer than batch_size rows."""
    rows = (row for row, _ in _pack(_token_ids(((None, text) for text in texts), tokenizer), section.seq_len))
    first_rows = list(itertools.islice(rows, section.eval_batches * section.batch_size))
    keep = len(first_rows) - len(first_rows) % section.batch_size or len(first_rows)
    return list(_batches(first_rows[:keep], section.batch_size, keep_partial=True))


def _training_filter(section: DataSection, evaluated: frozenset[bytes]) -> Callable[[str], bool]:
    """Which documents of ``dataset`` a unit trains on: not the held-out ones, or not those an eval dataset holds."""
    if section.eval_dataset is None:
        return lambda text: not is_held_out(text, section.eval_fraction)
    return lambda text: _digest(text) not in evaluated


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


def _open(spec: str, config: str | None, split: str) -> datasets.IterableDataset:
    """The unshuffled document stream of a local source (``split`` does not apply) or of a hub dataset's split."""
    files = _local_files(spec)
    if files is None:
        try:
            return datasets.load_dataset(spec, config, split=split, streaming=True)
        except _LOAD_ERRORS as error:
            raise DatasetLoadError(
                f"dataset '{spec}' could not be loaded from the Hugging Face hub (offline?): {first_line(error)}"
            ) from error
    builder = _builder(spec, files)
    options = {"sample_by": "paragraph"} if builder == "text" else {}
    try:
        return datasets.load_dataset(builder, data_files=files, split="train", streaming=True, **options)
    except _LOAD_ERRORS as error:
        raise DatasetLoadError(f"dataset '{spec}' could not be read: {first_line(error)}") from error


def _local_files(spec: str) -> list[str] | None:
    """Sorted files of a local glob, directory or file; None for a hub name; DatasetLoadError if missing."""
    path = Path(spec).expanduser()
    if glob.has_magic(spec):
        files = sorted(p for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
    elif path.is_dir():
        files = sorted(
            str(p)
            for p in path.rglob("*")
            if p.is_file() and p.suffix.lower() in _BUILDERS and not _hidden(p.relative_to(path))
        )
    elif path.is_file():
        files = [str(path)]
    elif looks_local(spec) or path.suffix.lower() in _BUILDERS:
        raise DatasetLoadError(f"dataset path '{spec}' does not exist")
    else:
        return None
    if not files:
        raise DatasetLoadError(f"dataset path '{spec}' has no {'/'.join(_BUILDERS)} files")
    return files


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


def _builder(spec: str, files: list[str]) -> str:
    """The one ``datasets`` builder for all files; DatasetLoadError for unsupported or mixed types."""
    suffixes = {Path(file).suffix.lower() for file in files}
    unsupported = sorted(suffixes - _BUILDERS.keys())
    if unsupported:
        raise DatasetLoadError(
            f"dataset '{spec}': unsupported file type '{unsupported[0]}' (use {', '.join(_BUILDERS)})"
        )
    builders = {_BUILDERS[suffix] for suffix in suffixes}
    if len(builders) > 1:
        raise DatasetLoadError(f"dataset '{spec}' mixes file types {sorted(suffixes)}: use one kind")
    return builders.pop()


def _texts(
    documents: Iterable[dict], section: DataSection, keep: Callable[[str], bool], source: str | None = None
) -> Iterator[str]:
    """Stripped non-blank documents that ``keep`` selects, in stream order (``source``: the dataset's name in errors,
    by default ``section.dataset``)."""
    for example in documents:
        if section.text_column not in example:
            columns = ", ".join(list(example)[:8]) + (", ..." if len(example) > 8 else "")
            raise DatasetLoadError(
                f"dataset '{source or section.dataset}' has no column '{section.text_column}' "
                f"(columns: {columns}; set --text-column)"
            )
        text = example[section.text_column]
        if not isinstance(text, str) or not text.strip():
            continue
        text = text.strip()
        if keep(text):
            yield text


def _token_ids(
    texts: Iterator[tuple[K, str]], tokenizer: transformers.PreTrainedTokenizerBase
) -> Iterator[tuple[K, list[int]]]:
    """Token ids of each (key, document) followed by eos, with its key (tokenized in chunks for speed)."""
    eos = tokenizer.eos_token_id
    while chunk := list(itertools.islice(texts, _TOKENIZE_CHUNK)):
        keys = [key for key, _ in chunk]
        encoded = tokenizer([text for _, text in chunk], add_special_tokens=False, verbose=False)["input_ids"]
        for key, ids in zip(keys, encoded):
            yield key, ids + [eos]


def _pack(documents: Iterator[tuple[K, list[int]]], seq_len: int) -> Iterator[tuple[list[int], K]]:
    """Concatenate documents and cut rows of exactly ``seq_len`` tokens (a final shorter rest is dropped); each row
    with the key of the document it ends in."""
    buffer: list[int] = []
    for key, ids in documents:
        buffer.extend(ids)
        full = len(buffer) // seq_len
        for row in range(full):
            yield buffer[row * seq_len : (row + 1) * seq_len], key
        buffer = buffer[full * seq_len :]


def _batches(rows: Iterable[list[int]], batch_size: int, keep_partial: bool) -> Iterator[torch.Tensor]:
    rows = iter(rows)
    while batch := list(itertools.islice(rows, batch_size)):
        if len(batch) < batch_size and not keep_partial:
            return
        yield torch.tensor(batch, dtype=torch.long)


def _epoch_seed(shard_seed: int, epoch: int) -> int:
    """A 32-bit shuffle seed derived from the peer's shard seed and the epoch."""
    digest = hashlib.blake2b(f"{shard_seed}:{epoch}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big")
