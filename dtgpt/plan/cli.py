"""`scripts/plan.py` and `train.py --dry-run`: print a plan, or why the layout is impossible."""

from __future__ import annotations

import argparse
import json
import math
from typing import Callable

from dtgpt.config import Config, ConfigError, load_config
from dtgpt.plan.layout import plan_layout
from dtgpt.plan.report import format_plan
from dtgpt.plan.results import LayoutError


def main(cfg: Config, world_size: int | None = None, **options) -> int:
    """`train.py --dry-run`: print the plan; 0 when every rank fits, 1 when one does not,
    2 when the layout is impossible."""
    as_json = options.pop("as_json", False)
    try:
        plan = plan_layout(cfg, world_size, **options)
    except LayoutError as e:
        if as_json:
            print(json.dumps({"possible": False, "errors": e.errors}))
        else:
            print("\n".join(f"error: impossible layout: {err}" for err in e.errors))
        return 2
    print(json.dumps(plan.to_dict()) if as_json else format_plan(cfg, plan))
    return 0 if plan.fits else 1


def positive(kind: type) -> Callable[[str], float]:
    """An argparse type: a finite number > 0 (a rate or size of 0 divided the time by zero, a
    negative or NaN one printed a plan of negative or NaN days)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an int' if kind is int else 'a number'}") from None
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"{text} must be a finite number > 0")
        return value

    return parse


def cli(argv: list[str]) -> int:
    """scripts/plan.py: [--config F] [--section.key=value ... | Megatron flags] [--json] [--check] ..."""
    parser = argparse.ArgumentParser(
        prog="plan.py", description="Plan a layout without GPUs: per-rank parameters and memory, bubble, training time."
    )
    parser.add_argument("--config", help="TOML config file (default: the built-in defaults, set by the overrides and Megatron flags)")
    parser.add_argument("--world-size", type=positive(int), help="GPUs (default pp*dp_replicate*dp_shard*cp*tp, dp_shard -1 as 1, or as the fewest ranks ep folds out of)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--tflops", type=positive(float), default=140.0, help="achieved TFLOP/s per GPU (default 140)")
    parser.add_argument("--nvlink-gbps", type=positive(float), default=300.0, help="GB/s a GPU sends within a node, for tp (default 300)")
    parser.add_argument("--ib-gbps", type=positive(float), default=25.0, help="GB/s a GPU sends across nodes, for pp and dp (default 25)")
    parser.add_argument("--gpu-memory-gib", type=positive(float), default=80.0, help="memory per GPU (default 80)")
    parser.add_argument("--tokens", type=positive(float), default=300e9, help="tokens to train, for the time (default 300e9)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a rank does not fit in --gpu-memory-gib")
    parser.add_argument("--all-ranks", action="store_true", help="build every pp rank, not one per kind of stage")
    parser.add_argument("--fused-attention", action="store_true",
                        help="count no a*s*s attention scores (flash or memory-efficient SDPA; default: Korthikanti's unfused core)")
    args, overrides = parser.parse_known_args(argv)
    try:
        # Validated by the planner, which reports an impossible layout in its own words.
        cfg = load_config(args.config, overrides, check=False)
    except ConfigError as e:
        print(f"error: {e}")
        return 2
    code = main(
        cfg, args.world_size, as_json=args.json, tflops=args.tflops, tokens=args.tokens,
        gpu_memory_gib=args.gpu_memory_gib, all_ranks=args.all_ranks, nvlink_gbps=args.nvlink_gbps,
        ib_gbps=args.ib_gbps, fused_attention=args.fused_attention,
    )  # fmt: skip
    return code if args.check or code == 2 else 0
