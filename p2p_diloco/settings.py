"""Where a unit's configuration comes from: a preset, a TOML file, command-line flags and keyword overrides, in
increasing priority (:func:`load_config`), and the command line's flags, one per field of config.py.

``join --help`` shows the settings a volunteer changes (:data:`VOLUNTEER_SETTINGS`: the run and its peers, the model,
the data, where the unit keeps its files, its limits, and the outer settings every unit of a run must share);
``--help-all`` shows every flag. New settings go to TOML files and presets, not to ``--help``.
"""

from __future__ import annotations

import argparse
import tomllib
import typing
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from p2p_diloco.config import (
    SECTIONS,
    ConfigError,
    NetworkSection,
    PeerConfig,
    config_error,
    flag_of,
    old_names,
)
from p2p_diloco.presets import PRESETS

VOLUNTEER_SETTINGS: dict[str, tuple[str, ...]] = {
    "network": ("run_id", "initial_peers", "host_maddrs", "announce_maddrs", "identity_path", "admission"),
    "model": ("model", "model_config_path", "device", "dtype", "lora_r"),
    "data": ("dataset", "seq_len", "batch_size"),
    "run": ("work_dir", "save_dir", "max_steps", "max_time_s", "nproc_per_node"),
    "outer": ("inner_steps", "fragments", "codec", "outer_lr", "outer_momentum"),
}
GROUP_TITLES = {
    "network": "the run and its peers",
    "model": "the model",
    "data": "the data",
    "inner": "the inner optimizer",
    "outer": "outer rounds (every unit of a run must share these)",
    "run": "this unit",
}
_MODEL_SOURCES = ("model", "model_config", "model_config_path")


def add_config_arguments(parser: argparse.ArgumentParser, sections: tuple[str, ...] = tuple(SECTIONS),
                         brief: bool = False) -> None:  # fmt: skip
    """Add ``--config FILE`` and one ``--field-name`` flag per field of ``sections`` (all default to "not given"),
    grouped by section. ``brief``: ``--help`` shows only :data:`VOLUNTEER_SETTINGS` and ``--help-all`` every flag."""
    parser.add_argument("--config", type=Path, help="TOML file with [model], [data], [inner], [outer], ... sections")
    if "model" in sections:
        presets = ", ".join(sorted(PRESETS))
        helped = f"start from a shipped preset: {presets} (--config and flags override it)"
        parser.add_argument("--preset", metavar="NAME", help=helped)
    if brief:
        parser.add_argument("--help-all", action=_HelpAll, nargs=0, help="show every setting's flag and exit")
    for section_name in sections:
        section = SECTIONS[section_name]
        group = parser.add_argument_group(GROUP_TITLES[section_name])
        for name, field in section.model_fields.items():
            kwargs: dict[str, Any] = dict(dest=f"{section_name}.{name}", default=argparse.SUPPRESS,
                                          help=_help(field), metavar=name.upper())  # fmt: skip
            if _is_bool(field.annotation):
                kwargs["action"] = argparse.BooleanOptionalAction
                del kwargs["metavar"]
            elif _is_list(field.annotation):
                kwargs["nargs"] = "*"
            action = group.add_argument(flag_of(name), *map(flag_of, old_names(field)), **kwargs)
            if brief and name not in VOLUNTEER_SETTINGS.get(section_name, ()):
                action.help, action.full_help = argparse.SUPPRESS, action.help  # type: ignore[attr-defined]


class _HelpAll(argparse.Action):
    """``--help-all``: the help with every flag shown."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:  # fmt: skip
        for action in parser._actions:  # argparse has no public list of a parser's actions
            action.help = getattr(action, "full_help", action.help)
        parser.print_help()
        parser.exit()


def _help(field: Any) -> str:
    """A flag's help line: the field's description and its default, when it has one (argparse needs '%' escaped)."""
    default = None if field.is_required() else field.get_default(call_default_factory=True)
    said = " (required)" if field.is_required() else f" (default: {default})" if default not in (None, []) else ""
    return f"{field.description or ''}{said}".strip().replace("%", "%%")


def _is_list(annotation: Any) -> bool:
    return typing.get_origin(annotation) is list


def _is_bool(annotation: Any) -> bool:
    return annotation is bool


def load_config(
    args: argparse.Namespace | None = None,
    toml_path: Path | None = None,
    preset: str | None = None,
    **overrides: Any,
) -> PeerConfig:
    """Build a validated config from a preset (``PRESETS``), a TOML file, parsed CLI flags and keyword overrides, in
    increasing priority. ``args`` may carry ``config`` and ``preset`` themselves (the ``--config`` and ``--preset``
    flags).

    ``overrides`` use ``section__field`` keys, e.g. ``outer__inner_steps=10``. Raises :class:`ConfigError`.
    """
    cli = vars(args) if args is not None else {}
    preset = preset or cli.get("preset")
    toml_path = toml_path or cli.get("config")
    if preset is not None and preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r} (presets: {', '.join(sorted(PRESETS))})")
    layers = [_section_layer(PRESETS[preset], f"preset {preset}")] if preset is not None else []
    if toml_path is not None:
        layers.append(_section_layer(_read_toml(Path(toml_path)), f"config file {toml_path}"))
    layers.append([(*key.split(".", 1), value) for key, value in cli.items() if "." in key])
    override_layer = []
    for key, value in overrides.items():
        section_name, _, field_name = key.partition("__")
        if section_name not in SECTIONS or not field_name:
            raise ConfigError(f"invalid override {key!r}: expected section__field with a section in {sorted(SECTIONS)}")
        override_layer.append((section_name, field_name, value))
    layers.append(override_layer)
    raw: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for layer in layers:
        if any(section == "model" and name in _MODEL_SOURCES for section, name, _ in layer):
            for source in _MODEL_SOURCES:  # a higher layer choosing the model source replaces a lower one's choice
                raw["model"].pop(source, None)
        for section_name, field_name, value in layer:
            raw[section_name][_current_name(section_name, field_name)] = value
    try:
        return PeerConfig(**{name: values for name, values in raw.items() if values or name in ("model", "data")})
    except ValidationError as error:
        raise config_error(error) from None


def _current_name(section_name: str, field_name: str) -> str:
    """The field's name for one of its old names; any other name as it is."""
    for name, field in SECTIONS[section_name].model_fields.items():
        if field_name in old_names(field):
            return name
    return field_name


def _section_layer(sections: dict[str, Any], source: str) -> list[tuple[str, str, Any]]:
    """(section, field, value) of a TOML-shaped mapping. Raises ConfigError for an unknown section."""
    layer = []
    for section_name, values in sections.items():
        if section_name not in SECTIONS or not isinstance(values, dict):
            raise ConfigError(f"{source}: unknown section [{section_name}]")
        layer += [(section_name, field_name, value) for field_name, value in values.items()]
    return layer


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"config file {path} is unreadable: {error}") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"config file {path} is not valid TOML: {error}") from None


def load_network_section(args: argparse.Namespace) -> NetworkSection:
    """The [network] section alone (bootstrap and status commands), from ``--config`` and flags."""
    raw: dict[str, Any] = {}
    config_path = vars(args).get("config")
    if config_path is not None:
        raw.update(_read_toml(Path(config_path)).get("network", {}))
    raw.update({key.split(".", 1)[1]: value for key, value in vars(args).items() if key.startswith("network.")})
    try:
        return NetworkSection(**raw)
    except ValidationError as error:
        raise config_error(error) from None


def config_toml(config: PeerConfig) -> str:
    """``config`` as a TOML file that ``--config`` reads back into the same config, its keys the flags' names (unset
    optional fields are left out)."""
    import tomli_w

    sections = config.model_dump(mode="json", exclude_none=True, by_alias=True)
    return tomli_w.dumps({name: sections[name] for name in SECTIONS})
