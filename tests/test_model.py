"""Model loading, deterministic initialisation, fingerprints, errors and atomic export (offline, CPU)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import datasets
import huggingface_hub
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import p2p_diloco
from p2p_diloco.config import ModelSection
from p2p_diloco.unit.model import (
    ModelLoadError,
    embedding_indices,
    export_pretrained,
    load_model,
    model_fingerprint,
    resolve_device,
)

TINY = Path(p2p_diloco.__file__).parent / "assets" / "tiny-gpt2"


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hub offline mode, as HF_HUB_OFFLINE=1 would set it at import time."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


def tiny_copy(tmp_path: Path, **config_changes: object) -> Path:
    """A copy of the embedded tiny-gpt2 directory with some config.json fields changed."""
    target = tmp_path / "tiny"
    shutil.copytree(TINY, target)
    config = json.loads((target / "config.json").read_text())
    config.update(config_changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().float().cpu() for name, tensor in model.state_dict().items()}


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    first, second = state(a), state(b)
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name


def test_same_seed_builds_identical_weights_and_different_seed_does_not() -> None:
    first = load_model(ModelSection(model_config_path=str(TINY), seed=7, device="cpu"))
    torch.manual_seed(12345)  # the global RNG state must not matter
    second = load_model(ModelSection(model_config_path=str(TINY / "config.json"), seed=7, device="cpu"))
    other = load_model(ModelSection(model_config_path=str(TINY), seed=8, device="cpu"))
    assert_same_weights(first.model, second.model)
    attention = [loaded.model.transformer.h[0].attn.c_attn.weight for loaded in (first, other)]
    assert not torch.equal(*attention)
    assert first.model.training and first.device == torch.device("cpu")
    assert first.tokenizer.pad_token_id == first.tokenizer.eos_token_id == 0
    assert sum(p.numel() for p in first.model.parameters()) < 1_200_000


def test_dtype_is_applied_without_changing_init_or_fingerprint() -> None:
    fp32 = load_model(ModelSection(model_config_path=str(TINY), device="cpu"))
    bf16 = load_model(ModelSection(model_config_path=str(TINY), device="cpu", dtype="bfloat16"))
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    for a, b in zip(fp32.model.parameters(), bf16.model.parameters()):
        assert torch.equal(a.to(torch.bfloat16), b)
    assert fp32.fingerprint == bf16.fingerprint


def test_fingerprint_is_stable_and_depends_on_architecture(tmp_path: Path) -> None:
    base = load_model(ModelSection(model_config_path=str(TINY), seed=1, device="cpu"))
    again = load_model(ModelSection(model_config_path=str(TINY), seed=2, device="cpu"))
    deeper = load_model(ModelSection(model_config_path=str(tiny_copy(tmp_path, n_layer=3)), device="cpu"))
    assert len(base.fingerprint) == 16 and int(base.fingerprint, 16) >= 0
    assert base.fingerprint == again.fingerprint == model_fingerprint(base.model, len(base.tokenizer))
    assert deeper.fingerprint != base.fingerprint
    assert model_fingerprint(base.model, len(base.tokenizer) + 1) != base.fingerprint


@pytest.mark.parametrize("name", ["./no/such/model", "/no/such/model", "~/no-such-model", "tests/no-such-model"])
def test_missing_local_model_fails_at_once_with_one_line(name: str) -> None:
    started = time.perf_counter()
    with pytest.raises(ModelLoadError) as caught:
        load_model(ModelSection(model=name))
    assert time.perf_counter() - started < 1.0
    assert str(caught.value) == f"model '{name}' not found: no such local file or directory"


def test_unknown_hub_model_fails_at_once_when_offline(offline: None) -> None:
    started = time.perf_counter()
    with pytest.raises(ModelLoadError) as caught:
        load_model(ModelSection(model="no-such-org/no-such-model"))
    assert time.perf_counter() - started < 2.0
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(
        "model 'no-such-org/no-such-model' not found: not a local directory and not loadable from the Hugging Face hub"
    )


def test_missing_config_and_tokenizer_are_reported(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"^model config '\./nope/config.json' not found"):
        load_model(ModelSection(model_config_path="./nope/config.json"))
    with pytest.raises(ModelLoadError, match=r"^tokenizer '\./no-tokenizer' not found"):
        load_model(ModelSection(model_config_path=str(TINY), tokenizer="./no-tokenizer", device="cpu"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(
        ModelLoadError, match=r"^tokenizer '.*empty' could not be built: it needs a tokenizer.json"
    ) as caught:
        load_model(ModelSection(model_config_path=str(TINY), tokenizer=str(empty), device="cpu"))
    assert "\n" not in str(caught.value)


def test_gguf_folders_are_explained(tmp_path: Path) -> None:
    folder = tmp_path / "gguf-only"
    folder.mkdir()
    (folder / "model-q8_0.gguf").write_bytes(b"GGUF")  # never read: the folder is checked first
    with pytest.raises(
        ModelLoadError, match=r"holds GGUF weights and no config.json: add --gguf-file model-q8_0.gguf$"
    ):
        load_model(ModelSection(model=str(folder), device="cpu"))
    with pytest.raises(ModelLoadError, match=r"'model-q4.gguf' is not in the model folder .*model-q8_0.gguf\)$"):
        load_model(ModelSection(model=str(folder), gguf_file="model-q4.gguf", device="cpu"))


def test_a_bare_vocab_and_merges_folder_loads_as_byte_level_bpe(tmp_path: Path) -> None:
    reference = AutoTokenizer.from_pretrained(TINY)
    bpe = json.loads((TINY / "tokenizer.json").read_text())["model"]
    folder = tmp_path / "vocab-merges"
    folder.mkdir()
    (folder / "vocab.json").write_text(json.dumps(bpe["vocab"]))
    merges = [" ".join(merge) if isinstance(merge, list) else merge for merge in bpe["merges"]]
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    loaded = load_model(ModelSection(model_config_path=str(TINY), tokenizer=str(folder), device="cpu"))
    text = "Call me Ishmael. Some years ago"
    assert loaded.tokenizer(text)["input_ids"] == reference(text)["input_ids"]
    assert len(loaded.tokenizer) == len(reference)


def test_tokenizer_larger_than_model_vocabulary_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="tokenizer has 4096 tokens but the model's embedding has only 1000 rows"):
        load_model(ModelSection(model_config_path=str(tiny_copy(tmp_path, vocab_size=1000)), device="cpu"))


def test_missing_pad_token_becomes_eos(tmp_path: Path) -> None:
    source = tiny_copy(tmp_path)
    tokenizer_config = json.loads((source / "tokenizer_config.json").read_text())
    del tokenizer_config["pad_token"]
    (source / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    assert AutoTokenizer.from_pretrained(source).pad_token is None
    loaded = load_model(ModelSection(model_config_path=str(source), device="cpu"))
    assert loaded.tokenizer.pad_token == loaded.tokenizer.eos_token == "<|endoftext|>"


def test_resolve_device() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="CUDA is not available"):
            resolve_device("cuda")


def test_export_round_trips_and_reloads_as_pretrained(tmp_path: Path) -> None:
    loaded = load_model(ModelSection(model_config_path=str(TINY), seed=3, device="cpu"))
    with torch.no_grad():
        loaded.model.transformer.ln_f.weight.add_(0.5)  # trained weights, not a fresh init
    save_dir = export_pretrained(loaded.model, loaded.tokenizer, tmp_path / "out" / "final")
    assert save_dir == tmp_path / "out" / "final"
    reloaded = AutoModelForCausalLM.from_pretrained(save_dir)
    assert_same_weights(loaded.model, reloaded)
    assert (
        AutoTokenizer.from_pretrained(save_dir)("Call me Ishmael")["input_ids"]
        == loaded.tokenizer("Call me Ishmael")["input_ids"]
    )
    again = load_model(ModelSection(model=str(save_dir), device="cpu"))
    assert_same_weights(loaded.model, again.model)
    assert again.fingerprint == loaded.fingerprint


class _FailingTokenizer:
    """A tokenizer whose save fails half-way through an export."""

    def save_pretrained(self, save_directory: Path) -> None:
        (Path(save_directory) / "partial.json").write_text("{")
        raise OSError("disk full")


def test_export_replaces_only_a_complete_directory(tmp_path: Path) -> None:
    first = load_model(ModelSection(model_config_path=str(TINY), seed=1, device="cpu"))
    second = load_model(ModelSection(model_config_path=str(TINY), seed=2, device="cpu"))
    save_dir = tmp_path / "final"
    export_pretrained(first.model, first.tokenizer, save_dir)
    before = {path.name: path.read_bytes() for path in save_dir.iterdir()}

    with pytest.raises(OSError, match="disk full"):
        export_pretrained(second.model, _FailingTokenizer(), save_dir)
    assert {path.name: path.read_bytes() for path in save_dir.iterdir()} == before
    assert [path.name for path in tmp_path.iterdir()] == ["final"]

    export_pretrained(second.model, second.tokenizer, save_dir)
    assert_same_weights(second.model, AutoModelForCausalLM.from_pretrained(save_dir))
    assert [path.name for path in tmp_path.iterdir()] == ["final"]


def test_embedding_indices_name_the_token_and_position_embeddings() -> None:
    loaded = load_model(ModelSection(model_config_path=str(TINY), device="cpu"))
    trained = [param for param in loaded.model.parameters() if param.requires_grad]
    names = [name for name, param in loaded.model.named_parameters() if param.requires_grad]
    assert {names[index] for index in embedding_indices(loaded.model, trained)} == {
        "transformer.wte.weight", "transformer.wpe.weight"
    }  # fmt: skip
