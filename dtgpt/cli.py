"""The command line of train.py: --config, overrides, --print-config, --dry-run.

Config errors print one line naming the key, the value and the rule, and exit 2 without a
traceback; nothing has been started by then.
"""

from __future__ import annotations

import argparse
import sys

from dtgpt.config import ConfigError, load_config, to_toml


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="train.py",
        description="Pretrain a GPT model. Override any config key with --section.key=value.",
    )
    parser.add_argument("--config", help="TOML config file (default: built-in defaults)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as TOML and exit")
    parser.add_argument("--dry-run", action="store_true", help="plan the layout (memory, parameters) and exit")
    return parser.parse_known_args(argv)


def run_main(argv: list[str], model_provider, datasets_provider) -> int:
    args, overrides = parse_args(argv)
    try:
        cfg = load_config(args.config, overrides)
        if args.print_config:
            print(to_toml(cfg), end="")
            return 0
        if args.dry_run:
            from dtgpt.plan import main as plan_main

            return plan_main(cfg)
        from dtgpt.training import pretrain

        pretrain(cfg, model_provider, datasets_provider)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
