"""Megatron's data_path grammar (`"0.3 prefA 0.7 prefB"`, or bare prefixes), in one place.

Validation parses every data path with it, so a malformed blend is one line before any process
group exists; the data code reads the same (prefixes, weights) from it.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from dtgpt.config.sections import ConfigError


def parse_blend(data_path: Sequence[str], key: str = "data.data_path") -> tuple[list[str], Optional[list[float]]]:
    """Megatron's blend list -> (prefixes, weights), weights None when the list has none.

    ["0.3", "a", "0.7", "b"] is a weighted blend (datasets of weight 0 are dropped); ["a"] or
    ["a", "b"] are unweighted. An entry holding several words ("0.3 a 0.7 b") counts as those words.
    """
    items = [word for entry in data_path for word in str(entry).split()]
    if not items:
        raise ConfigError(f"{key} is empty")

    def is_number(s: str) -> bool:
        try:
            float(s)
            return True
        except ValueError:
            return False

    if not any(is_number(s) for s in items):
        return items, None
    if not (len(items) % 2 == 0 and all(is_number(s) for s in items[0::2])
            and not any(is_number(s) for s in items[1::2])):
        raise ConfigError(f"{key}={list(data_path)!r} must be prefixes, or weight/prefix pairs like ['0.3', 'a', '0.7', 'b']")
    weights = [float(s) for s in items[0::2]]
    if any(w < 0 or not math.isfinite(w) for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"{key}={list(data_path)!r}: weights must be finite, >= 0, with a positive sum")
    kept = [(p, w) for p, w in zip(items[1::2], weights) if w > 0]
    return [p for p, _ in kept], [w for _, w in kept]
