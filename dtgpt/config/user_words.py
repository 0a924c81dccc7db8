"""Errors in the words the user typed: a run launched with Megatron-LM's flags is told about
`--override-opt-param-scheduler`, not `optimizer.override_opt_param_scheduler=true`.

Rules name dtgpt's keys (`section.key` or `section.key=value`) once, in one place; the command
line knows how the user spoke. A key the user set with a Megatron flag is named by that flag; a
key set with `--section.key` or in the config file keeps its name; any other key that has a
Megatron flag is named by the flag when the command line used Megatron's flags at all.
"""

from __future__ import annotations

import re

from dtgpt.config.megatron_flags import CHOICES, FROM_FILE, Mapping, flag_table

KEY_MENTION = re.compile(r"(?<![\w./-])(?:--)?([a-z]+)\.([a-z][a-z0-9_]*)(?:=(\[[^\]]*\]|'[^']*'|\"[^\"]*\"|[^\s,;:)]+))?")
"""`section.key`, `--section.key` or `section.key=value` (a list, a quoted value, or one up to a space or punctuation)."""


class UserWords:
    def __init__(self, overrides: list[tuple[str, str, str]], file_keys: set[str] = frozenset()):
        """`overrides`: megatron_flags.translate(...).overrides; `file_keys`: section.key names
        the config file sets."""
        self.typed_flags: dict[str, str] = {}  # key -> the Megatron flag's name the user typed
        self.typed_keys = set(file_keys)
        self.from_file: dict[str, str] = {}  # key -> the flag and file its value was read from
        for key, _value, spelling in overrides:
            word = spelling.split()[0].split("=")[0][2:]
            if word in FROM_FILE:
                self.from_file[key] = spelling
            elif "." in word:
                self.typed_keys.add(key)
            else:
                self.typed_flags[key] = word
        self.speaks_megatron = bool(self.typed_flags or self.from_file)

    def say(self, message: str) -> str:
        """The message with each dtgpt key the user would not have typed named as a Megatron flag."""
        return KEY_MENTION.sub(self._mention, message) if self.speaks_megatron else message

    def _mention(self, match: re.Match) -> str:
        key, value = f"{match[1]}.{match[2]}", match[3]
        if key in self.from_file:  # the words of a file: the key with them, and where they came from
            return f"{match[0]} (read from {self.from_file[key]})"
        if key in self.typed_keys:
            return match[0]
        tail = ""
        if value and value.endswith(".") and not value.startswith(("'", '"')):
            value, tail = value[:-1], "."  # the sentence's full stop
        flag = self._flag(key, value)
        return match[0] if flag is None else flag + tail

    def _flag(self, key: str, value: str | None) -> str | None:
        mappings = [m for m in flag_table().values() if m.key == key]
        if not mappings:
            return None
        typed = self.typed_flags.get(key)
        if value is None:
            return "--" + (typed or _canonical(key, mappings).flag.name)
        plain = _as_typed(value)
        if typed in CHOICES:  # a flag whose value names a setting: the value the user's flag gives
            choice = next((c for c, text in CHOICES[typed][1].items() if text == plain.lower()), None)
            return f"--{typed} {choice}" if choice else None
        if mappings[0].flag.arity == "0":  # a switch: the flag that sets this value
            wanted = plain.lower() == "true"
            fits = sorted((m for m in mappings if m.value == wanted), key=lambda m: (m.flag.name != typed, m.flag.name))
            return "--" + fits[0].flag.name if fits else None
        name = typed if typed else _canonical(key, mappings).flag.name
        return f"--{name} {plain}"


def _canonical(key: str, mappings: list[Mapping]) -> Mapping:
    """The flag named as the key, else the first by name."""
    name = key.split(".")[1].replace("_", "-")
    return next((m for m in mappings if m.flag.name == name), min(mappings, key=lambda m: m.flag.name))


def _as_typed(value: str) -> str:
    """A value as a flag takes it: unquoted, and a list as its items (`['0.5', 'a']` -> `0.5 a`)."""
    if value.startswith("["):
        return " ".join(item.strip().strip("'\"") for item in value[1:-1].split(",") if item.strip())
    return value.strip("'\"")
