"""Text loading, held-out split, per-peer order, packing and errors (offline, real datasets/tokenizers)."""

from __future__ import annotations

import itertools
import json
import random
import time
from pathlib import Path

import datasets
import huggingface_hub
import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

import p2p_diloco
from p2p_diloco.config import DataSection
from p2p_diloco.unit.data import DataPosition, DatasetLoadError, is_held_out, load_text_data

ASSETS = Path(p2p_diloco.__file__).parent / "assets"
MOBY_DICK = ASSETS / "corpus" / "moby_dick.txt"
EOS = "<|endoftext|>"
WORDS = "whale sea ship captain harpoon boat deck mast sail oil night storm crew ocean wind".split()


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(ASSETS / "tiny-gpt2")


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hub offline mode, as HF_HUB_OFFLINE=1 would set it at import time."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


def make_documents(count: int, seed: int = 0) -> list[str]:
    """Distinct multi-line ASCII documents (lossless through byte-level BPE)."""
    rng = random.Random(seed)
    return [
        f"document {i} begins\n" + " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 40))) for i in range(count)
    ]


def write_text_corpus(path: Path, documents: list[str]) -> Path:
    path.write_text("\n\n".join(documents) + "\n")
    return path


def decoded_documents(batches: list[torch.Tensor], tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The complete documents of consecutive batches (the stream starts on a document boundary)."""
    ids = torch.cat([batch.flatten() for batch in batches]).tolist()
    text = tokenizer.decode(ids, clean_up_tokenization_spaces=False)
    return text.split(EOS)[:-1]


def test_moby_dick_batches(tokenizer: PreTrainedTokenizerBase) -> None:
    section = DataSection(dataset=str(MOBY_DICK), seq_len=64, batch_size=4, eval_batches=3)
    started = time.perf_counter()
    data = load_text_data(section, tokenizer, shard_seed=0)
    batch = next(data.train_batches())
    assert time.perf_counter() - started < 5.0
    assert batch.shape == (4, 64) and batch.dtype == torch.long
    assert 0 <= int(batch.min()) and int(batch.max()) < len(tokenizer)
    assert len(data.eval_batches) == 3
    assert all(b.shape == (4, 64) and b.dtype == torch.long for b in data.eval_batches)


def test_held_out_split_is_disjoint_identical_across_peers_and_order_is_per_peer(
    tmp_path: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    documents = make_documents(80)
    held_out = {doc for doc in documents if is_held_out(doc, 0.25)}
    training = set(documents) - held_out
    assert held_out and training
    section = DataSection(
        dataset=str(write_text_corpus(tmp_path / "corpus.txt", documents)),
        seq_len=16,
        batch_size=4,
        eval_fraction=0.25,
        eval_batches=4,
    )
    peers = [load_text_data(section, tokenizer, shard_seed=seed) for seed in (0, 1)]

    for a, b in zip(peers[0].eval_batches, peers[1].eval_batches, strict=True):
        assert torch.equal(a, b)
    eval_documents = decoded_documents(peers[0].eval_batches, tokenizer)
    assert eval_documents and set(eval_documents) <= held_out
    assert eval_documents == [doc for doc in documents if doc in held_out][: len(eval_documents)]

    orders = []
    for peer in peers:
        stream = decoded_documents(list(itertools.islice(peer.train_batches(), 150)), tokenizer)
        assert len(stream) > 2 * len(training)
        epochs = [stream[: len(training)], stream[len(training) : 2 * len(training)]]
        assert all(sorted(epoch) == sorted(training) for epoch in epochs)  # each epoch: every doc once
        assert epochs[0] != epochs[1]  # reshuffled every epoch
        orders.append(epochs[0])
    assert orders[0] != orders[1]  # different shard seeds read different orders


def test_same_shard_seed_gives_the_same_stream(tmp_path: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    corpus = write_text_corpus(tmp_path / "c.txt", make_documents(40))
    section = DataSection(dataset=str(corpus), seq_len=16, batch_size=2)
    data = load_text_data(section, tokenizer, shard_seed=5)
    first = list(itertools.islice(data.train_batches(), 20))
    second = list(itertools.islice(load_text_data(section, tokenizer, shard_seed=5).train_batches(), 20))
    again = list(itertools.islice(data.train_batches(), 20))  # each call restarts at epoch 0
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(first, second, again, strict=True))


def test_a_stream_resumed_at_its_position_trains_on_no_document_twice(
    tmp_path: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    section = DataSection(dataset=str(write_text_corpus(tmp_path / "c.txt", make_documents(60))), seq_len=16,
                          batch_size=2, eval_fraction=0.1)  # fmt: skip
    data = load_text_data(section, tokenizer, shard_seed=5)
    whole = decoded_documents(list(itertools.islice(data.train_batches(), 400)), tokenizer)
    training = sorted(set(whole))
    epoch = whole[: len(training)]  # the first epoch's order
    assert sorted(epoch) == training
    stream = data.train_batches()
    trained = list(itertools.islice(stream, 7))
    position = stream.position
    assert position.epoch == 0 and 0 < position.documents < len(training)
    saved = DataPosition.from_dict(position.as_dict())  # as a checkpoint holds it
    resumed = decoded_documents(list(itertools.islice(data.train_batches(saved), 200)), tokenizer)
    rest = len(training) - position.documents
    seen = set(decoded_documents(trained, tokenizer)) | {epoch[position.documents - 1]}  # the last one was cut
    assert resumed[:rest] == epoch[position.documents :], "the epoch goes on where the trained batches ended"
    assert not seen & set(resumed[:rest]), "nothing of this epoch is trained on twice"
    assert sorted(resumed[rest : rest + len(training)]) == training, "then the next epochs as before"
    with pytest.raises(ValueError):
        DataPosition.from_dict({"epoch": -1, "documents": 2})


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_json_input_with_text_column(tmp_path: Path, tokenizer: PreTrainedTokenizerBase, suffix: str) -> None:
    records = [{"id": i, "body": doc} for i, doc in enumerate(make_documents(60))]
    path = tmp_path / f"data{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(record) + "\n" for record in records))
    else:
        path.write_text(json.dumps(records))
    section = DataSection(dataset=str(path), text_column="body", seq_len=16, batch_size=2, eval_fraction=0.2)
    data = load_text_data(section, tokenizer, shard_seed=0)
    assert next(data.train_batches()).shape == (2, 16)
    assert set(decoded_documents(data.eval_batches, tokenizer)) <= {r["body"] for r in records}


def test_missing_text_column(tmp_path: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"body": "some text"}) + "\n")
    with pytest.raises(DatasetLoadError) as caught:
        load_text_data(DataSection(dataset=str(path)), tokenizer, shard_seed=0)
    assert str(caught.value) == f"dataset '{path}' has no column 'text' (columns: body; set --text-column)"


def test_directory_and_glob_sources(tmp_path: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    documents = make_documents(60)
    (tmp_path / "corpus" / "sub").mkdir(parents=True)
    (tmp_path / "corpus" / ".cache").mkdir()
    write_text_corpus(tmp_path / "corpus" / "a.txt", documents[:30])
    write_text_corpus(tmp_path / "corpus" / "sub" / "b.md", documents[30:])
    write_text_corpus(tmp_path / "corpus" / ".cache" / "ignored.txt", ["never read " * 20])
    for spec in (tmp_path / "corpus", tmp_path / "corpus" / "**" / "*.*"):
        section = DataSection(dataset=str(spec), seq_len=16, batch_size=2, eval_fraction=0.2)
        data = load_text_data(section, tokenizer, shard_seed=0)
        stream = decoded_documents(list(itertools.islice(data.train_batches(), 100)), tokenizer)
        assert set(stream) <= set(documents)


@pytest.mark.parametrize("spec", ["./missing.txt", "no/such/dir/data.jsonl", "/nowhere/*.txt", "corpus.txt"])
def test_missing_dataset_path(spec: str, tokenizer: PreTrainedTokenizerBase) -> None:
    with pytest.raises(DatasetLoadError, match=r"^dataset path '.*' (does not exist|has no .* files)$"):
        load_text_data(DataSection(dataset=spec), tokenizer, shard_seed=0)


def test_unknown_hub_dataset_fails_at_once_when_offline(offline: None, tokenizer: PreTrainedTokenizerBase) -> None:
    started = time.perf_counter()
    with pytest.raises(DatasetLoadError) as caught:
        load_text_data(DataSection(dataset="no-such-org/no-such-dataset"), tokenizer, shard_seed=0)
    assert time.perf_counter() - started < 2.0
    assert str(caught.value).startswith(
        "dataset 'no-such-org/no-such-dataset' could not be loaded from the Hugging Face hub (offline?): "
    )
    assert "\n" not in str(caught.value)


def test_eval_batches_are_full_or_one_small_batch(tmp_path: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    corpus = write_text_corpus(tmp_path / "c.txt", make_documents(200))
    for batch_size, eval_fraction in ((4, 0.2), (64, 0.05)):
        section = DataSection(
            dataset=str(corpus), seq_len=16, batch_size=batch_size, eval_fraction=eval_fraction, eval_batches=100
        )
        held_out_rows = (
            sum(len(tokenizer(doc)["input_ids"]) + 1 for doc in make_documents(200) if is_held_out(doc, eval_fraction))
            // 16
        )
        batches = load_text_data(section, tokenizer, shard_seed=0).eval_batches
        if held_out_rows >= batch_size:
            assert len(batches) == held_out_rows // batch_size
            assert all(batch.shape == (batch_size, 16) for batch in batches)
        else:
            assert [batch.shape for batch in batches] == [(held_out_rows, 16)]


def test_empty_or_too_small_corpus(tmp_path: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n\n")
    with pytest.raises(DatasetLoadError, match="has no held-out sequence"):
        load_text_data(DataSection(dataset=str(empty)), tokenizer, shard_seed=0)
    unsupported = tmp_path / "data.csv"
    unsupported.write_text("text\nhello\n")
    with pytest.raises(DatasetLoadError, match="unsupported file type '.csv'"):
        load_text_data(DataSection(dataset=str(unsupported)), tokenizer, shard_seed=0)


def test_all_documents_held_out_means_no_training_data(tmp_path: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    documents = [doc for doc in make_documents(400) if is_held_out(doc, 0.05)]
    corpus = write_text_corpus(tmp_path / "c.txt", documents)
    section = DataSection(dataset=str(corpus), seq_len=8, eval_fraction=0.05)
    with pytest.raises(DatasetLoadError, match="has no training documents"):
        load_text_data(section, tokenizer, shard_seed=0)


def test_an_eval_dataset_gives_the_eval_batches_and_is_never_trained_on(
    tmp_path: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    """--eval-dataset: the first documents of the eval files make the eval batches, identical for every shard seed;
    training reads every document of --dataset (held-out hashes no longer apply) except those the eval read."""
    train_docs, eval_docs = make_documents(120, seed=1), make_documents(30, seed=2)
    eval_docs = [doc.replace("document", "evaluation") for doc in eval_docs]
    corpus = write_text_corpus(tmp_path / "train.txt", train_docs + eval_docs[:5])  # the corpus holds 5 eval docs
    evaluation = write_text_corpus(tmp_path / "eval.txt", eval_docs)
    section = DataSection(dataset=str(corpus), eval_dataset=str(evaluation), seq_len=16, batch_size=2, eval_batches=3)
    first, second = (load_text_data(section, tokenizer, shard_seed=seed) for seed in (0, 1))
    assert all(torch.equal(a, b) for a, b in zip(first.eval_batches, second.eval_batches))
    evaluated = tokenizer.decode(torch.cat([b.flatten() for b in first.eval_batches]).tolist())
    assert evaluated.startswith(eval_docs[0] + EOS + "evaluation 1 begins")
    trained = decoded_documents(list(itertools.islice(first.train_batches(), 400)), tokenizer)
    assert set(train_docs) <= set(trained) and not set(eval_docs[:5]) & set(trained)


def test_an_unreadable_or_too_small_eval_dataset_is_a_clear_error(
    tmp_path: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    corpus = write_text_corpus(tmp_path / "train.txt", make_documents(50))
    missing = DataSection(dataset=str(corpus), eval_dataset=str(tmp_path / "nope.txt"))
    with pytest.raises(DatasetLoadError, match="does not exist"):
        load_text_data(missing, tokenizer, shard_seed=0)
    tiny = write_text_corpus(tmp_path / "tiny.txt", ["two words"])
    with pytest.raises(DatasetLoadError, match="eval dataset '.*tiny.txt' has no sequence of 128 tokens"):
        load_text_data(DataSection(dataset=str(corpus), eval_dataset=str(tiny)), tokenizer, shard_seed=0)
