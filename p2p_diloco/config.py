"""Typed, validated configuration of a learning unit: its sections and fields (where a configuration comes from,
presets, TOML files, flags and overrides: settings.py).

Every field has one name used everywhere: in TOML (inside its section, e.g. ``[outer] outer_lr = 0.5``)
and on the command line (``--outer-lr 0.5``). Invalid values raise :class:`ConfigError` with one line that
names the field, so the CLI can print it and exit non-zero.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from p2p_diloco.errors import UserError

Codec = Literal["fp32", "fp16", "int8"]  # the wire codec of a fragment round (compression.py: hivemind's codec of each)
CODECS: tuple[Codec, ...] = ("fp32", "fp16", "int8")
TRACKERS = ("tensorboard", "wandb")  # --report-to's trackers, each the name of the package it needs


class ConfigError(UserError, ValueError):
    """A configuration value is invalid; the message is one line meant for the user."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(_Section):
    model: str | None = Field(None, description="Hugging Face hub name or local directory of a pretrained causal LM")
    model_config_path: str | None = Field(
        None,
        description="pre-train from this config (hub name, directory or config.json) instead of weights",
        validation_alias=AliasChoices("model_config", "model_config_path"),
        serialization_alias="model_config",  # the flag's name, in --print-config's TOML
        json_schema_extra={"flag": "--model-config"},
    )
    tokenizer: str | None = Field(None, description="tokenizer hub name or directory; None: the model's")
    gguf_file: str | None = Field(None, description="load weights from this GGUF file inside --model")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="dtype the weights are loaded, trained and stored in (AdamW then updates them in this dtype: "
        "prefer --autocast over float32 weights)",
    )
    autocast: Literal["none", "bfloat16", "float16"] = Field(
        "none",
        description="run forward and backward in this dtype over float32 master weights (float16 adds a loss scaler)",
    )
    gradient_checkpointing: bool = Field(False, description="recompute activations in backward to save memory")
    attn_implementation: str | None = Field(
        None, description="attention kernel passed to transformers: eager, sdpa, flash_attention_2, ... (default: its)"
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto picks CUDA when present")
    seed: int = Field(0, description="seed of the initial weights (identical on every peer) and of data order")
    lora_r: int | None = Field(
        None, ge=1, le=4096, description="train and average LoRA adapters of this rank (peft) instead of the weights"
    )
    lora_alpha: int = Field(16, ge=1, description="LoRA scaling numerator (the adapters' output times alpha/r)")
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapters' input")
    lora_target_modules: list[str] = Field(
        default_factory=lambda: ["all-linear"],
        description="names (or name suffixes) of the modules that get adapters; all-linear: every linear layer but "
        "the output head",
    )

    @model_validator(mode="after")
    def _one_source(self) -> ModelSection:
        if (self.model is None) == (self.model_config_path is None):
            raise ValueError("give exactly one of --model (pretrained weights) or --model-config (pre-train)")
        if self.autocast != "none" and self.dtype != "float32":
            raise ValueError("--autocast needs --dtype float32: the weights it computes from are the master copy")
        return self


class DataSection(_Section):
    dataset: str = Field(..., description="hub dataset name (streamed) or local text/json/jsonl/parquet files/dir")
    dataset_config: str | None = Field(None, description="hub dataset configuration name")
    text_column: str = Field("text", description="column holding the raw text")
    seq_len: int = Field(128, ge=8, le=65536, description="tokens per packed training sequence")
    batch_size: int = Field(8, ge=1, description="sequences per micro-batch")
    eval_fraction: float = Field(0.02, gt=0.0, lt=0.5, description="fraction of documents held out for eval")
    eval_batches: int = Field(8, ge=1, description="batches in one held-out evaluation")
    eval_dataset: str | None = Field(
        None,
        description="evaluate on these files or this hub dataset instead (no unit trains on a document it holds); "
        "default: the documents of --dataset that --eval-fraction holds out",
    )
    eval_split: str = Field("validation", description="the hub split of --eval-dataset")


class InnerSection(_Section):
    optimizer: Literal["adamw", "sgd"] = Field(
        "adamw", description="inner optimizer; sgd (plain, no momentum) makes DiLoCo at H = 1 exactly data-parallel"
    )
    inner_lr: float = Field(1e-3, gt=0.0, le=1.0, description="peak learning rate of the inner optimizer")
    weight_decay: float = Field(0.1, ge=0.0, le=1.0, description="AdamW decoupled weight decay")
    warmup_steps: int = Field(20, ge=0, description="linear warm-up inner steps")
    decay_steps: int = Field(10_000, ge=1, description="cosine decay length in inner steps (then held at 10%)")
    grad_clip: float = Field(1.0, gt=0.0, description="max global gradient norm")
    grad_accum: int = Field(1, ge=1, le=1024, description="micro-batches accumulated per inner step")


def _aliases(*old_names: str) -> dict[str, Any]:
    """``json_schema_extra`` of a renamed field: its old names, still accepted as TOML keys, flags and overrides
    (:func:`load_config` reads them as the field's name)."""
    return {"aliases": list(old_names)}


OverlapRule = Literal["keep", "discount", "align", "mix"]  # diloco.py's Overlap
Schedule = Literal["clock", "steps"]  # when rounds are due (rounds/engine.py, rounds/clock.py)


class OuterSection(_Section):
    inner_steps: int = Field(20, ge=1, description="H: inner steps between two outer rounds")
    warmup_rounds: int = Field(
        0, ge=0, le=8, description="k: the first k rounds come after H/2^k, H/2^(k-1), ... inner steps, then every H "
        "(short rounds while the loss falls fast)",
    )  # fmt: skip
    # Defaults: a plain average of the units' parameters (outer lr 1, no momentum), the best outer step in fine-tuning
    # over 200 rounds and in every run of tens of rounds the quality bench measured; pre-training from scratch over 200
    # rounds, momentum 0.5 was better in every seed (results/quality/horizon/README.md). The literature's Nesterov (lr
    # 0.7, momentum 0.9) lost in every regime measured.
    outer_lr: float = Field(1.0, gt=0.0, le=10.0, description="outer SGD learning rate on the pseudo-gradient")
    outer_momentum: float = Field(0.0, ge=0.0, lt=1.0, description="outer SGD momentum (0: a plain average)")
    nesterov: bool = Field(True, description="Nesterov outer momentum (with a momentum above 0)")
    overlap_rule: OverlapRule = Field(
        "keep",
        description="what a unit keeps of the inner steps it made while a round was in flight: keep, discount "
        "(× --overlap-factor), align (less what opposes the round's step) or mix (factor·θ + (1 − factor)·φ_new)",
    )
    overlap_factor: float = Field(0.5, ge=0.0, le=1.0, description="the factor of --overlap-rule discount and mix")
    quorum: int = Field(1, ge=1, description="K: smallest group whose average is accepted (1 = never wait)")
    target_group_size: int = Field(8, ge=1, le=256, description="a group stops recruiting at this size")
    # the matchmaking window: how long a round recruits members (formerly "grace": the old names still work)
    window_fraction: float = Field(
        0.5, gt=0.0, le=4.0, description="matchmaking window as a fraction of H measured inner-step times",
        json_schema_extra=_aliases("grace_fraction"),
    )  # fmt: skip
    min_window_s: float = Field(
        2.0, gt=0.0, description="lower bound of the matchmaking window (seconds)",
        json_schema_extra=_aliases("min_grace_s"),
    )  # fmt: skip
    max_window_s: float = Field(
        120.0, gt=0.0, description="upper bound of the matchmaking window (seconds)",
        json_schema_extra=_aliases("max_grace_s"),
    )  # fmt: skip
    schedule: Schedule = Field(
        "clock",
        description="clock: rounds at boundaries of shared time, every power-of-two seconds nearest H inner steps, in "
        "groups every unit derives alike; steps: H of the unit's own steps after its previous round",
    )
    settle_rounds: int = Field(
        4, ge=0, le=16, description="rounds at exit that only average φ, so that units leaving together agree (more "
        "while a unit finishing with this one has not met it, up to the final rounds' bound)",
    )  # fmt: skip
    allreduce_timeout_s: float = Field(30.0, gt=0.0, description="bound on one all-reduce once a group formed")
    sync_momentum: bool = Field(
        True, description="average the outer momentum with the parameters (2x bytes; never at momentum 0: none to sync)"
    )
    fragments: int = Field(1, ge=1, le=64, description="P: streaming fragments syncing on staggered schedules")
    max_in_flight: int = Field(2, ge=1, description="most rounds in flight at once (consensus rounds included)")
    codec: Codec = Field(
        "fp32",
        description="wire codec: fp32 averages outer-step proposals, fp16/int8 compressed pseudo-gradients",
    )
    merge: Literal["mean", "rda"] = Field(
        "mean",
        description="how a group merges pseudo-gradients: their weighted mean, or rda (fp32 only: each tensor's norm "
        "and unit direction averaged apart, embeddings by the mean; sends one more copy of the model per round)",
    )
    consensus_tolerance: float = Field(
        1e-3, gt=0.0, description="lossy codecs: a consensus round follows any round whose members' φ differed more"
    )
    error_feedback: bool = Field(True, description="carry what a lossy codec dropped into the next pseudo-gradient")
    consensus_every_rounds: int = Field(
        10,
        ge=0,
        description="lossy codecs: fp32 re-averaging of a fragment's φ every N of its rounds (0: off)",
    )

    @model_validator(mode="after")
    def _window_bounds(self) -> OuterSection:
        if self.min_window_s > self.max_window_s:
            raise ValueError("--min-window-s must not exceed --max-window-s")
        if self.quorum > self.target_group_size:
            raise ValueError("--quorum must not exceed --target-group-size")
        if self.merge == "rda" and self.codec != "fp32":
            raise ValueError("--merge rda needs --codec fp32 (a lossy codec's error feedback assumes the mean)")
        return self


class NetworkSection(_Section):
    run_id: str = Field("p2p-diloco", description="swarm namespace: peers with the same run id train together")
    initial_peers: list[str] = Field(default_factory=list, description="multiaddrs of any live swarm member")
    host_maddrs: list[str] = Field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"], description="listen addresses")
    announce_maddrs: list[str] = Field(default_factory=list, description="addresses announced to other peers")
    identity_path: str | None = Field(None, description="private key file: a stable peer id across restarts")
    admission: str | None = Field(
        None, description="a private run's admission of this peer's identity (file from `p2p-diloco admit`)"
    )
    join_timeout_s: float = Field(30.0, gt=0.0, description="give up reaching the initial peers after this long")
    reachability: Literal["auto", "public", "private"] = Field(
        "auto",
        description="whether other peers can connect to this unit: auto (a dial-back check by the initial peers), "
        "public, or private (behind NAT or a firewall: reached through relays, else a client with outbound "
        "connections only)",
    )
    use_relays: bool = Field(
        True,
        description="an unreachable unit is reached through relays that confirm they reach it (--no-use-relays: it "
        "joins as a client, which leads no group and serves no state)",
    )
    relays: list[str] = Field(
        default_factory=list,
        description="multiaddrs of relays for an unreachable unit: bootstrap nodes or reachable units, which relay by "
        "default (default: the initial peers)",
    )

    @field_validator("run_id")
    @classmethod
    def _run_id_charset(cls, value: str) -> str:
        if not value or not all(ch.isalnum() or ch in "-_" for ch in value) or len(value) > 64:
            raise ValueError("run_id must be 1-64 characters of letters, digits, '-' or '_'")
        return value


class RunSection(_Section):
    max_steps: int | None = Field(None, ge=1, description="stop after this many inner steps of this peer")
    max_time_s: float | None = Field(None, gt=0.0, description="stop after this many seconds of training")
    stop_at: float | None = Field(None, gt=0.0, description="stop training at this time (seconds since the epoch)")
    work_dir: str = Field("runs/peer", description="checkpoints, metrics.jsonl and logs of this peer")
    save_dir: str | None = Field(None, description="export the consensus model here (save_pretrained) on exit")
    checkpoint_every_rounds: int = Field(
        5, ge=1, description="write a local checkpoint every N outer rounds (and at the first a process merges)"
    )
    export_every_rounds: int | None = Field(
        None, ge=1, description="also export the consensus model to --save-dir every N outer rounds while training"
    )
    eval_every_rounds: int = Field(1, ge=1, description="evaluate the consensus model every N outer rounds")
    progress: bool = Field(True, description="show console progress bars (on a terminal only)")
    report_to: list[Literal["tensorboard", "wandb"]] = Field(
        default_factory=list,
        description="experiment trackers: tensorboard (event files in the work dir), wandb (W&B's env vars apply), "
        "none; several as tensorboard,wandb",
    )
    threads: int | None = Field(None, ge=1, description="torch CPU threads (default: torch's choice)")
    export_adapter: bool = Field(
        False, description="with --lora-r: export the adapter alone (peft's format) instead of the merged model"
    )
    nproc_per_node: int = Field(
        1, ge=1, description="ranks of this unit (data-parallel processes, one device each) started by torch's launcher"
    )
    max_restarts: int = Field(3, ge=0, description="with several ranks: restarts of the unit after a rank failed")
    shard_model: bool = Field(
        False,
        description="with several ranks: shard θ, its gradients and AdamW state over them (FSDP), for a model whose "
        "training state does not fit one device; rank 0 keeps θ whole on the host",
    )

    @model_validator(mode="after")
    def _exports_have_a_place(self) -> RunSection:
        if self.export_every_rounds is not None and self.save_dir is None:
            raise ValueError("--export-every-rounds needs --save-dir: the folder the model is exported to")
        return self

    @field_validator("report_to", mode="before")
    @classmethod
    def _tracker_names(cls, value: Any) -> Any:
        """``tensorboard,wandb`` and ``["tensorboard", "wandb"]`` alike; ``none`` alone: no tracker."""
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            return value
        names = [name.strip() for item in value for name in str(item).split(",") if name.strip()]
        if "none" in names and len(names) > 1:
            raise ValueError("report_to 'none' cannot be combined with a tracker")
        for name in set(names) & set(TRACKERS):
            if importlib.util.find_spec(name) is None:
                raise ValueError(f"--report-to {name} needs the {name} package: pip install 'p2p_diloco[{name}]'")
        return [name for name in dict.fromkeys(names) if name != "none"]


class SwarmSections(_Section):
    """What a learning unit needs whoever trains it: its outer rounds, its network and its run (the library API,
    api.py, trains a model and optimizer of its caller's with these alone)."""

    outer: OuterSection = OuterSection()
    network: NetworkSection = NetworkSection()
    run: RunSection = RunSection()


class PeerConfig(SwarmSections):
    """Full configuration of one learning unit of ``p2p-diloco join``: the swarm's sections, and the model, data and
    inner optimizer it trains."""

    model: ModelSection
    data: DataSection
    inner: InnerSection = InnerSection()

    @model_validator(mode="after")
    def _adapter_export(self) -> PeerConfig:
        if self.run.export_adapter and self.model.lora_r is None:
            raise ValueError("--export-adapter needs --lora-r: without adapters there is no adapter to export")
        return self

    @model_validator(mode="after")
    def _sharding(self) -> PeerConfig:
        if not self.run.shard_model:
            return self
        if self.run.nproc_per_node < 2:
            raise ValueError("--shard-model needs --nproc-per-node 2 or more: one rank has nothing to shard over")
        if self.model.lora_r is not None:
            raise ValueError("--shard-model does not take --lora-r: adapters are small enough to replicate")
        if self.model.autocast == "float16":
            raise ValueError("--shard-model does not take --autocast float16 (no sharded loss scaler): use bfloat16")
        return self


SECTIONS: dict[str, type[_Section]] = {
    "model": ModelSection,
    "data": DataSection,
    "inner": InnerSection,
    "outer": OuterSection,
    "network": NetworkSection,
    "run": RunSection,
}


def flag_of(field_name: str) -> str:
    """The flag of a field (or of one of its old names)."""
    for section in SECTIONS.values():
        field = section.model_fields.get(field_name)
        if field is not None and isinstance(field.json_schema_extra, dict) and "flag" in field.json_schema_extra:
            return str(field.json_schema_extra["flag"])
    return "--" + field_name.replace("_", "-")


def old_names(field: Any) -> list[str]:
    """The old names of a renamed field (still read as its name)."""
    extra = field.json_schema_extra
    return list(extra.get("aliases", [])) if isinstance(extra, dict) else []


def config_error(error: ValidationError) -> ConfigError:
    """The first of a validation's errors as one line naming the field and its flag."""
    first = error.errors()[0]
    location = ".".join(str(part) for part in first["loc"])
    known = [str(part) for part in first["loc"] if str(part) in _all_field_names()]
    flag = f" ({flag_of(known[-1])})" if known else ""
    message = first["msg"].removeprefix("Value error, ")
    return ConfigError(f"invalid config {location}{flag}: {message}")


def swarm_sections(base: SwarmSections | None = None, **settings: Any) -> SwarmSections:
    """``base`` (default: the defaults) with ``settings`` given by field name (``inner_steps=50``, ``run_id="x"``:
    each name belongs to one of the [outer], [network] and [run] sections). Raises ConfigError for an unknown name
    or an invalid value."""
    sections = (base or SwarmSections()).model_dump()
    owners = {name: section for section in ("outer", "network", "run") for name in SECTIONS[section].model_fields}
    for name, value in settings.items():
        if name not in owners:
            raise ConfigError(f"unknown setting {name!r}: expected a field of [outer], [network] or [run]")
        sections[owners[name]][name] = value
    try:
        return SwarmSections(**sections)
    except ValidationError as error:
        raise config_error(error) from None


def _all_field_names() -> set[str]:
    """Every field's name, and its old names."""
    fields = [(name, field) for section in SECTIONS.values() for name, field in section.model_fields.items()]
    return {name for name, _ in fields} | {old for _, field in fields for old in old_names(field)}
