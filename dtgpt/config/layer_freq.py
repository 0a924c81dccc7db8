"""Megatron's per-block patterns: moe_layer_freq (which blocks hold a mixture of experts) and
window_attn_skip_freq (which blocks attend through a sliding window).

An int f: for moe_layer_freq block i (from 0) when i % f == 0; for window_attn_skip_freq block i
(from 1) unless i % f == 0. Or Megatron's per-layer pattern, one 0 or 1 per
block, written as a Python list expression: "[0,1,1,1]", "([0]*3+[1]*58)" (DeepSeek-V3's first
three blocks dense). Megatron evaluates that text with eval(); here only list literals of 0/1,
a list times a count, and list + list are read (the syntax tree checked node by node), so a
config or a command line never runs code.
"""

from __future__ import annotations

import ast
from functools import lru_cache

_MAX_ELEMENTS = 1 << 20  # far more blocks than any model; bounds what "[1]*10**9" could allocate


def _pattern_of(node: ast.AST, text: str, key: str) -> list[int]:
    def refuse(why: str) -> ValueError:
        return ValueError(f"{key}={text!r} {why}; write a list of 0/1 per block such as \"([0]*3+[1]*58)\"")

    if isinstance(node, ast.List):
        values = [n.value for n in node.elts if isinstance(n, ast.Constant)]
        if len(values) != len(node.elts) or any(type(v) is not int or v not in (0, 1) for v in values):
            raise refuse("has a list element that is not 0 or 1")
        return values
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _checked_length(_pattern_of(node.left, text, key) + _pattern_of(node.right, text, key), refuse)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        items, count = (node.left, node.right) if isinstance(node.right, ast.Constant) else (node.right, node.left)
        if not (isinstance(count, ast.Constant) and type(count.value) is int and 0 <= count.value <= _MAX_ELEMENTS):
            raise refuse("multiplies a list by something other than a count")
        return _checked_length(_pattern_of(items, text, key) * count.value, refuse)
    raise refuse("is neither an int nor a list expression of 0/1 (list literals, list * count, list + list)")


def _checked_length(pattern: list[int], refuse) -> list[int]:
    if len(pattern) > _MAX_ELEMENTS:
        raise refuse(f"has more than {_MAX_ELEMENTS} elements")
    return pattern


def moe_layer_pattern(freq: int | str, num_layers: int) -> tuple[bool, ...]:
    """For each of the num_layers blocks, whether it holds a mixture of experts."""
    return layer_pattern(freq, num_layers, "model.moe_layer_freq")


@lru_cache(maxsize=64)
def layer_pattern(freq: int | str, num_layers: int, key: str, from_one: bool = False) -> tuple[bool, ...]:
    """For each of the num_layers blocks, its bit of pattern `key`; an int f marks blocks i % f == 0
    counted from 0, or (from_one: window_attn_skip_freq's rule) blocks i % f != 0 counted from 1."""
    if isinstance(freq, str) and freq.strip().lstrip("+").isdigit():
        freq = int(freq)
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(f"{key}={freq} must be >= 1 (or a list of 0/1 per block)")
        return tuple((i + 1) % freq != 0 if from_one else i % freq == 0 for i in range(num_layers))
    try:
        tree = ast.parse(freq.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"{key}={freq!r} is not an int or a list expression") from None
    pattern = _pattern_of(tree.body, freq, key)
    if len(pattern) != num_layers:
        raise ValueError(f"{key}={freq!r} lists {len(pattern)} blocks, but model.num_layers={num_layers} (one 0/1 per block)")
    return tuple(bool(v) for v in pattern)
