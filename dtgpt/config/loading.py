"""Reading a config: TOML files, `--section.key=value` overrides and Megatron-LM's flags coerced
to the field types, unknown names rejected with the closest match; and writing the resolved
config back as TOML.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import types
import typing
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

from dtgpt.config.checkpoint_keys import CheckpointKeys
from dtgpt.config.megatron_flags import CONFLICT_WORDS, translate
from dtgpt.config.megatron_launch import apply_megatron_launch_rules
from dtgpt.config.megatron_vocab import apply_megatron_vocab_multiple
from dtgpt.config.moe_keys import MoEKeys
from dtgpt.config.muon_keys import MuonKeys
from dtgpt.config.pipeline_split import apply_virtual_stages
from dtgpt.config.pipeline_split_keys import PipelineSplitKeys
from dtgpt.config.run_outputs import apply_logs_follow_checkpoint
from dtgpt.config.precedence import COMMAND_LINE, FILE, resolve_conflicts
from dtgpt.config.sections import Config, ConfigError
from dtgpt.config.tokenizer_keys import TokenizerKeys
from dtgpt.config.validation import validate


# ---------------------------------------------------------------------------------------------
# Types and coercion


def _field_types(section_cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_cls)}


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return tp, False


def _with_article(name: str) -> str:
    return ("an " if name[0] in "aeiou" else "a ") + name


def _type_name(tp: Any) -> str:
    inner, optional = _unwrap_optional(tp)
    if typing.get_origin(inner) is list:
        name = f"list of {typing.get_args(inner)[0].__name__}"
    elif typing.get_origin(inner) is types.UnionType:  # int | str: model.moe_layer_freq
        name = " or ".join(a.__name__ for a in typing.get_args(inner))
    else:
        name = inner.__name__
    return f"{name} (or unset)" if optional else name


def _check_value(key: str, value: Any, tp: Any) -> Any:
    """Check a value read from TOML against the field type; ints are accepted for floats."""
    inner, optional = _unwrap_optional(tp)
    if value is None and optional:
        return None
    if typing.get_origin(inner) is list:
        elem = typing.get_args(inner)[0]
        if not isinstance(value, list):
            raise ConfigError(f"{key}={value!r} must be {_with_article(_type_name(tp))}")
        return [_check_value(f"{key}[{i}]", v, elem) for i, v in enumerate(value)]
    if inner is bool:
        ok = isinstance(value, bool)
    elif inner is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif inner is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, inner)
    if not ok:
        raise ConfigError(f"{key}={value!r} must be {_with_article(_type_name(tp))}")
    return value


def _coerce_text(key: str, text: str, tp: Any) -> Any:
    """Turn a command-line string into the field's type."""
    inner, optional = _unwrap_optional(tp)
    if optional and text.lower() in ("none", "null", ""):
        return None
    if inner is str and text.lower() in ("none", "null"):
        return ""  # a string key is unset by being empty
    if inner == int | str:  # an int where the text is one, else the text (model.moe_layer_freq)
        return int(text) if text.strip().isdigit() else text
    if typing.get_origin(inner) is list:
        elem = typing.get_args(inner)[0]
        stripped = text.strip()
        if stripped.startswith("["):
            try:
                parsed = tomllib.loads(f"v = {stripped}")["v"]
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"{key}={text!r} is not a valid list: {e}") from None
            return _check_value(key, parsed, tp)
        parts = [p for p in stripped.replace(",", " ").split() if p]
        return [_coerce_text(f"{key}[{i}]", p, elem) for i, p in enumerate(parts)]
    try:
        if inner is bool:
            lowered = text.lower()
            if lowered in ("true", "1", "yes", "on"):
                return True
            if lowered in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if inner is int:
            return int(text)
        if inner is float:
            return float(text)
    except ValueError:
        raise ConfigError(f"{key}={text!r} must be {_with_article(_type_name(tp))}") from None
    return text


def _closest(name: str, choices: list[str]) -> str:
    match = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else f"; valid names: {', '.join(choices)}"


def _section_classes() -> dict[str, type]:
    return {f.name: f.default_factory for f in dataclasses.fields(Config)}  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------
# Loading


def config_from_dict(data: dict[str, Any], source: str = "config") -> Config:
    """Build a Config from nested dicts, rejecting unknown sections and keys by name."""
    sections = _section_classes()
    cfg = Config()
    for section_name, values in data.items():
        if section_name not in sections and not isinstance(values, dict):
            raise ConfigError(_outside_sections(source, section_name, values, sections))
        if section_name not in sections:
            raise ConfigError(
                f"{source}: unknown section [{section_name}]{_closest(section_name, list(sections))}"
            )
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: [{section_name}] must be a table of keys")
        section = getattr(cfg, section_name)
        types_ = _field_types(type(section))
        for key, value in values.items():
            if key not in types_:
                raise ConfigError(
                    f"{source}: unknown key {section_name}.{key}{_closest(key, list(types_))}"
                )
            setattr(section, key, _check_value(f"{section_name}.{key}", value, types_[key]))
    return cfg


def _outside_sections(source: str, key: str, value: Any, sections: dict[str, type]) -> str:
    """A key written above every [section] header: name the section that holds a key of that name."""
    homes = [name for name, cls in sections.items() if key in _field_types(cls)]
    where = f"put it under [{homes[0]}]" if homes else f"no section has a key {key!r}"
    return f"{source}: {key} = {value!r} is outside any [section]; {where}"


def load_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as e:  # a directory, no permission, an I/O error
        raise ConfigError(f"config file {path} cannot be read: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text (is it a TOML file?)") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: malformed TOML: {e}") from None


def apply_override(cfg: Config, dotted_key: str, text: str) -> None:
    """Apply one `section.key=value` override given as text."""
    sections = _section_classes()
    if "." not in dotted_key:
        raise ConfigError(f"override --{dotted_key} must look like --section.key=value")
    section_name, key = dotted_key.split(".", 1)
    if section_name not in sections:
        raise ConfigError(f"unknown section in --{dotted_key}{_closest(section_name, list(sections))}")
    section = getattr(cfg, section_name)
    types_ = _field_types(type(section))
    if key not in types_:
        raise ConfigError(f"unknown key --{dotted_key}{_closest(key, list(types_))}")
    setattr(section, key, _coerce_text(dotted_key, text, types_[key]))


def split_overrides(args: list[str]) -> list[tuple[str, str]]:
    """`--a.b=1 --c.d 2 --num-layers 4` -> [("a.b", "1"), ("c.d", "2"), ("model.num_layers", "4")]:
    Megatron-LM's flags become overrides of their keys (dtgpt/config/megatron_flags.py)."""
    return [(key, value) for key, value, _ in translate(list(args)).overrides]


def _apply_command_line(cfg: Config, args: list[str], levels: dict[str, int]) -> None:
    """Apply the overrides in order. A Megatron flag and another command-line setting that give
    one key different values are refused (two `--section.key` settings: the last one counts)."""
    said: dict[str, tuple[Any, str]] = {}
    for key, value, spelling in translate(args).overrides:
        apply_override(cfg, key, value)
        levels[key] = COMMAND_LINE
        section, name = key.split(".", 1)
        now = getattr(getattr(cfg, section), name)
        if key in said and said[key][0] != now and not all(s.startswith(f"--{key}") for s in (said[key][1], spelling)):
            words = CONFLICT_WORDS.get(key, f"both set {key}, to {said[key][0]!r} and {now!r}; keep one")
            raise ConfigError(f"{said[key][1]} and {spelling} {words}")
        said[key] = (now, spelling)


def load_config(path: str | Path | None, overrides: list[str] = (), check: bool = True) -> Config:
    """Read a TOML file (or the defaults when path is None), apply overrides, validate (unless
    `check` is false).

    Where a command-line key and a file key cannot both hold, the command line wins (see
    dtgpt/config/precedence.py)."""
    data = load_toml(path) if path else {}
    cfg = config_from_dict(data, str(path))
    levels = {f"{s}.{k}": FILE for s, table in data.items() for k in table}
    file_save = cfg.checkpoint.save
    _apply_command_line(cfg, list(overrides), levels)
    apply_logs_follow_checkpoint(cfg, file_save, levels, FILE)
    said = translate(list(overrides))
    spellings = [spelling for _, _, spelling in said.overrides]
    apply_megatron_vocab_multiple(cfg, spellings, said.ignored, levels, bool(path))
    apply_megatron_launch_rules(cfg, spellings, said.ignored, levels, bool(path))
    resolve_conflicts(cfg, levels)
    apply_virtual_stages(cfg, levels)
    if check:
        validate(cfg)
    return cfg


# ---------------------------------------------------------------------------------------------
# Printing


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isinf(value) or math.isnan(value):
            return str(value)  # inf, -inf, nan: TOML's own spellings
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML; unset optional keys appear as comments."""
    lines = []
    later = {f.name for keys in (MoEKeys, MuonKeys, PipelineSplitKeys, TokenizerKeys, CheckpointKeys) for f in dataclasses.fields(keys)}
    for section_field in dataclasses.fields(cfg):
        section = getattr(cfg, section_field.name)
        if section_field.name == "faults":
            lines.append("# fault injection, for tests and drills (docs/faults.md): leave it at 0 in a real run")
        lines.append(f"[{section_field.name}]")
        # a [model] reads as the model first; its mixture-of-experts keys (a base class, so
        # first among the fields) come after the dense ones, as [parallel]'s uneven-split keys
        # come after the mesh, and [data]'s tokenizer keys after its data
        for f in sorted(dataclasses.fields(section), key=lambda f: f.name in later):
            if f.name == "num_experts":
                lines.append("# mixture of experts (unset num_experts: every block dense)")
            value = getattr(section, f.name)
            if value is None:
                lines.append(f"# {f.name} = (unset)")
            else:
                lines.append(f"{f.name} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)
