"""Reading the config.toml a dtgpt checkpoint was saved with, as the model it describes.

A saved config is resolved: it lists every key of the dtgpt that wrote it. A [model] key it
lacks was added to dtgpt after the save, so it means what dtgpt did before the key existed,
which is the key's default for every key but one: RoPE rotated interleaved channel pairs
before `rotary_interleaved` (whose default is Megatron's halves).
"""

from __future__ import annotations

from pathlib import Path

from dtgpt.config import Config, load_config, load_toml

BEFORE_THE_KEY = {"rotary_interleaved": True}
"""[model] keys whose meaning, in a config saved before they existed, is not their default."""


def read_saved_config(path: Path, check: bool = True) -> Config:
    """The config at `path`, written by a dtgpt save."""
    return as_saved(load_config(path, check=check), load_toml(path))


def as_saved(cfg: Config, saved: dict) -> Config:
    """`cfg`, read from the saved TOML tables `saved`, with the keys the save predates set to
    what they meant then (in place; returned)."""
    for key, before in BEFORE_THE_KEY.items():
        if key not in saved.get("model", {}):
            setattr(cfg.model, key, before)
    return cfg
