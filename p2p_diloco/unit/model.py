"""Load the trained causal LM and its tokenizer from a :class:`ModelSection`, and export the result.

Two sources (exactly one is configured):

* ``model``: pretrained weights, a Hugging Face hub name or a local directory, optionally a GGUF file inside
  it (``gguf_file``; weights are dequantised on load).
* ``model_config_path``: pre-training from a config (hub name, directory or ``config.json``); the weights
  are initialised under ``torch.manual_seed(seed)``, so every peer with the same seed starts from identical
  weights (built in float32 on the CPU, then cast and moved, so the dtype and device do not change them).

Every loading failure raises :class:`ModelLoadError` with one line for the user. A name that cannot be a
hub repository id (starts with ``.``, ``/`` or ``~``, has more than one ``/``, or its first folder exists
here) and does not exist fails at once; other names go to the hub, which fails at once under
``HF_HUB_OFFLINE=1`` (otherwise after the hub client's own retries).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import logging
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from p2p_diloco.config import ModelSection, OuterSection
from p2p_diloco.errors import UserError, first_line
from p2p_diloco.rounds.plan import RoundPlan
from p2p_diloco.unit.adapters import adapter_signature, saveable, with_adapters

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
# Hub repository ids: "name" or "owner/name" (huggingface_hub's validation rule, without the length cap).
_REPO_ID = re.compile(r"^(?:[\w\-.]+/)?[\w\-.]+$")
# What from_pretrained raises for missing, unreachable or unreadable sources.
_LOAD_ERRORS = (OSError, ValueError, KeyError, ImportError, RuntimeError)


class ModelLoadError(UserError):
    """The model or tokenizer cannot be loaded; the message is one line meant for the user."""


@dataclass
class LoadedModel:
    """A model ready to train (on ``device``, configured dtype, train mode) with its tokenizer.

    ``tokenizer`` always has a pad token. ``fingerprint`` identifies the architecture (see
    :func:`model_fingerprint`): peers may only average parameters when their fingerprints match.
    """

    model: transformers.PreTrainedModel
    tokenizer: transformers.PreTrainedTokenizerBase
    device: torch.device
    fingerprint: str
    autocast: torch.dtype | None = None  # the dtype forward and backward run in over the weights, None: theirs


def resolve_device(choice: str, local_rank: int = 0) -> torch.device:
    """``auto`` → CUDA when available, else CPU; on CUDA the device of ``local_rank`` (a unit's rank on this host).
    Raises ModelLoadError for ``cuda`` without CUDA, or a local rank without a CUDA device of its own."""
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' requested but CUDA is not available (use --device cpu or auto)")
    if local_rank >= torch.cuda.device_count():
        raise ModelLoadError(f"local rank {local_rank} has no CUDA device: this host has {torch.cuda.device_count()} "
                             "(give at most that many --nproc-per-node)")  # fmt: skip
    return torch.device("cuda", local_rank)


def model_fingerprint(model: torch.nn.Module, vocab_size: int, adapters: str = "") -> str:
    """16 hex chars of sha256 over the class name, ordered (name, shape, trained or frozen) of parameters, the vocab
    size and the adapter signature (adapters.py; empty without adapters).

    Independent of dtype, device and values: peers training in bf16 on GPU and fp32 on CPU agree.
    """
    digest = hashlib.sha256(type(model).__name__.encode())
    for name, parameter in model.named_parameters():
        frozen = "" if parameter.requires_grad else " frozen"
        digest.update(f"{name}:{tuple(parameter.shape)}{frozen};".encode())
    digest.update(f"vocab={vocab_size}".encode())
    if adapters:
        digest.update(f";{adapters}".encode())
    return digest.hexdigest()[:16]


def looks_local(name: str) -> bool:
    """True when ``name`` exists here or must be a local path: it starts with ``.``, ``/`` or ``~``, is not a
    valid hub repository id, or its first folder exists here."""
    path = Path(name).expanduser()
    if path.exists() or name.startswith((".", "/", "~")) or not _REPO_ID.match(name):
        return True
    return "/" in name and Path(name.split("/", 1)[0]).is_dir()


def load_model(section: ModelSection, local_rank: int = 0, on_host: bool = False) -> LoadedModel:
    """Load (``model``) or build (``model_config_path``) the model and its tokenizer, ready to train on the device of
    ``local_rank`` (``on_host``: left on the host, for its caller to shard and move; ``LoadedModel.device`` is still
    the device).

    Raises ModelLoadError (one line) for a missing or unloadable model, config or tokenizer, a tokenizer
    without pad/eos token, a tokenizer larger than the model's vocabulary, or an unavailable device.
    """
    device = resolve_device(section.device, local_rank)
    options = {"attn_implementation": section.attn_implementation} if section.attn_implementation else {}
    if section.model is not None:
        model = _pretrained_model(section.model, section.gguf_file, getattr(torch, section.dtype), options)
        tokenizer_source = section.tokenizer or section.model
        tokenizer_gguf = section.gguf_file if section.tokenizer is None else None
    else:
        assert section.model_config_path is not None  # guaranteed by ModelSection's validator
        model = _initialised_model(section.model_config_path, section.seed, options)
        tokenizer_source = section.tokenizer or _config_dir(section.model_config_path)
        tokenizer_gguf = None
    tokenizer = _load_tokenizer(tokenizer_source, tokenizer_gguf)
    _check_vocab(model, tokenizer)
    model = model.to(device="cpu" if on_host else device, dtype=getattr(torch, section.dtype))  # type: ignore[call-arg]  # decorated in transformers
    if section.gradient_checkpointing:
        _checkpoint_activations(model)
    if section.lora_r is not None:
        model = with_adapters(model, section)
    model.train()
    fingerprint = model_fingerprint(model, len(tokenizer), adapter_signature(section))
    autocast = None if section.autocast == "none" else getattr(torch, section.autocast)
    logger.info(
        "model ready: params=%d trained=%d dtype=%s autocast=%s device=%s fingerprint=%s",
        sum(p.numel() for p in model.parameters()),
        sum(p.numel() for p in model.parameters() if p.requires_grad),
        section.dtype,
        section.autocast,
        device,
        fingerprint,
    )
    return LoadedModel(model=model, tokenizer=tokenizer, device=device, fingerprint=fingerprint, autocast=autocast)


def embedding_indices(model: torch.nn.Module, trained: Sequence[torch.Tensor]) -> frozenset[int]:
    """Positions in ``trained`` of the parameters of the model's embedding layers (token and position embeddings;
    a tied output layer shares the token embedding's)."""
    owned = {id(param) for module in model.modules() if isinstance(module, torch.nn.Embedding)
             for param in module.parameters()}  # fmt: skip
    return frozenset(index for index, param in enumerate(trained) if id(param) in owned)


def round_plan(outer: OuterSection, model: torch.nn.Module, trained: Sequence[torch.Tensor]) -> RoundPlan:
    """The round plan of a unit that trains ``trained``, parameters of ``model`` (its embeddings merged by their mean
    under RDA). Raises ConfigError when the model cannot be split into ``outer.fragments`` fragments."""
    return RoundPlan.from_config(outer, [tensor.shape for tensor in trained], embedding_indices(model, trained))


def export_pretrained(
    model: transformers.PreTrainedModel,
    tokenizer: transformers.PreTrainedTokenizerBase,
    save_dir: Path,
    adapter_only: bool = False,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``save_pretrained`` of the model and tokenizer to ``save_dir``; return ``save_dir``.

    The files are written into a temporary sibling folder that replaces ``save_dir`` only once complete:
    on any failure the previous ``save_dir`` (if any) is left untouched, no partial folder remains, and the
    error propagates. GGUF-loaded models (which refuse ``save_pretrained``) are saved as plain weights. A model with
    LoRA adapters is saved merged (a plain model of the base architecture), or with ``adapter_only`` as its adapter
    alone (adapters.py). ``state_dict``, the weights by name, replaces the model's own (a model sharded over ranks).
    """
    save_dir = Path(save_dir)
    with staged_dir(save_dir) as staging:
        _serializable(saveable(model, adapter_only), state_dict).save_pretrained(staging, state_dict=state_dict)
        tokenizer.save_pretrained(staging)
    logger.info("model exported: save_dir=%s", save_dir)
    return save_dir


@contextlib.contextmanager
def staged_dir(target: Path) -> Iterator[Path]:
    """A temporary sibling folder of ``target`` to write into, which replaces ``target`` once the block completes:
    if the block raises (or the process dies) the previous ``target`` (if any) is left untouched, no partial folder
    remains (but a hidden temporary one after a kill), and the error propagates."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield staging
        _replace_dir(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _pretrained_model(
    name: str, gguf_file: str | None, dtype: torch.dtype, options: dict[str, str]
) -> transformers.PreTrainedModel:
    """from_pretrained straight into ``dtype`` (no float32 copy of a half-precision model on the way; transformers
    before 5 is asked for its low-memory loading, which later releases always do), failures wrapped in
    ModelLoadError."""
    _check_model_folder(name, gguf_file)
    kwargs: dict[str, object] = {"gguf_file": gguf_file, **options} if gguf_file else dict(options)
    return _load(
        "model",
        name,
        lambda: AutoModelForCausalLM.from_pretrained(name, dtype=dtype, low_cpu_mem_usage=True, **kwargs),
    )


def _check_model_folder(name: str, gguf_file: str | None) -> None:
    """For a local folder, what transformers would misreport: GGUF weights without ``--gguf-file`` ("Should have a
    `model_type` key") and a ``--gguf-file`` that is not there (it would try the hub). Raises ModelLoadError."""
    folder = Path(name).expanduser()
    if not folder.is_dir():
        return
    ggufs = sorted(path.name for path in folder.glob("*.gguf"))
    if gguf_file is None and ggufs and not (folder / "config.json").exists():
        raise ModelLoadError(f"model folder '{name}' holds GGUF weights and no config.json: add --gguf-file {ggufs[0]}")
    if gguf_file is not None and not (folder / gguf_file).is_file():
        found = f"its GGUF files: {', '.join(ggufs)}" if ggufs else "it holds no .gguf file"
        raise ModelLoadError(f"--gguf-file '{gguf_file}' is not in the model folder '{name}' ({found})")


def _initialised_model(config_path: str, seed: int, options: dict[str, str]) -> transformers.PreTrainedModel:
    """from_config with weights drawn under ``seed`` (fp32, CPU: the same weights whatever the dtype and device they
    are cast to); the global RNG state is left untouched."""
    config = _load("model config", config_path, lambda: AutoConfig.from_pretrained(config_path))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _load("model", config_path, lambda: AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                                                 **options))  # fmt: skip


def _checkpoint_activations(model: transformers.PreTrainedModel) -> None:
    """Turn on activation (gradient) checkpointing; ModelLoadError for a model that has none."""
    if not model.supports_gradient_checkpointing:
        raise ModelLoadError(f"{type(model).__name__} does not support --gradient-checkpointing")
    # transformers 5 renamed it (the old name warns); 4.x has only the old one
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    model.config.use_cache = False  # a cache is useless in training and incompatible with recomputation


def _config_dir(config_path: str) -> str:
    """The folder of a local config.json, else the source itself (a directory or hub name)."""
    path = Path(config_path).expanduser()
    return str(path.parent) if path.is_file() else config_path


def _load_tokenizer(source: str, gguf_file: str | None) -> transformers.PreTrainedTokenizerBase:
    """AutoTokenizer with a pad token (eos when it has none); ModelLoadError when impossible."""
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    if _bare_byte_level_bpe(source):
        logger.info("tokenizer '%s' has only vocab.json and merges.txt: loading it as GPT-2's byte-level BPE", source)
        kwargs["tokenizer_type"] = "gpt2"
    tokenizer = _load("tokenizer", source, lambda: AutoTokenizer.from_pretrained(source, **kwargs))
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelLoadError(f"tokenizer '{source}' has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _bare_byte_level_bpe(source: str) -> bool:
    """A local folder with a byte-level BPE's vocab.json and merges.txt and nothing that names the tokenizer's class
    (AutoTokenizer would fail with "Couldn't instantiate the backend tokenizer")."""
    folder = Path(source).expanduser()
    files = {path.name for path in folder.iterdir()} if folder.is_dir() else set()
    return {"vocab.json", "merges.txt"} <= files and not files & {
        "tokenizer.json",
        "tokenizer_config.json",
        "config.json",
    }


def _check_vocab(model: transformers.PreTrainedModel, tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    """Every token id of the tokenizer must index the model's input embeddings."""
    weight = model.get_input_embeddings().weight
    assert isinstance(weight, torch.Tensor), "an input embedding holds its table as a tensor"
    rows = weight.shape[0]
    if len(tokenizer) > rows:
        raise ModelLoadError(
            f"tokenizer has {len(tokenizer)} tokens but the model's embedding has only {rows} rows "
            "(use the tokenizer the model was built for)"
        )


def _load(what: str, name: str, loader: Callable[[], _T]) -> _T:
    """Run a from_pretrained-style ``loader`` for ``what`` named ``name``; failures → one-line ModelLoadError."""
    local = looks_local(name)
    if local and not Path(name).expanduser().exists():
        raise ModelLoadError(f"{what} '{name}' not found: no such local file or directory")
    if not local:
        logger.info("%s '%s' is not a local path: loading it from the Hugging Face hub", what, name)
    try:
        return loader()
    except _LOAD_ERRORS as error:
        logger.debug("loading %s %r failed", what, name, exc_info=True)
        if "Couldn't instantiate the backend tokenizer" in str(error):
            raise ModelLoadError(
                f"{what} '{name}' could not be built: it needs a tokenizer.json or a tokenizer_config.json naming its "
                "class (save_pretrained writes both), or sentencepiece / tiktoken to convert its slow tokenizer"
            ) from error
        if local:
            raise ModelLoadError(f"{what} '{name}' could not be loaded: {first_line(error)}") from error
        raise ModelLoadError(
            f"{what} '{name}' not found: not a local directory and not loadable from the Hugging Face hub "
            f"(offline?): {first_line(error)}"
        ) from error


def _serializable(
    model: transformers.PreTrainedModel, state_dict: dict[str, torch.Tensor] | None = None
) -> transformers.PreTrainedModel:
    """The model itself, or for a GGUF-loaded one (dequantised, but refusing save_pretrained) a plain copy (of
    ``state_dict`` when given, else of the model's weights)."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None or quantizer.is_serializable():
        return model
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    plain = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    plain.load_state_dict(model.state_dict() if state_dict is None else state_dict, strict=state_dict is None)
    return plain


def _replace_dir(complete: Path, target: Path) -> None:
    """Rename ``complete`` to ``target``; an existing ``target`` is moved aside first and deleted after."""
    if not target.exists():
        complete.rename(target)
        return
    backup = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    backup.rmdir()
    target.rename(backup)
    try:
        complete.rename(target)
    except BaseException:
        backup.rename(target)
        raise
    shutil.rmtree(backup, ignore_errors=True)
