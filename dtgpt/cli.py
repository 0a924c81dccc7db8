"""The command line of train.py: --config, overrides, Megatron-LM's flags, --print-config, --dry-run.

Config errors print one line naming the key, the value and the rule, and exit 2 without a
traceback; nothing has been started by then. Bad data files and unusable checkpoints (a load
directory without one, another model's, a save that failed) do the same; anything else is a bug
and keeps its traceback. The line names settings as the user gave them (a Megatron flag for a run
launched with Megatron's flags: dtgpt/config/user_words.py) and is printed once per node however
many ranks meet it (dtgpt/error_once.py).
"""

from __future__ import annotations

import argparse
import atexit
import faulthandler
import logging
import os
import shutil
import sys
import threading

from dtgpt.config import ConfigError, load_config, load_toml, to_toml, validate
from dtgpt.config.megatron_flags import ignored_note, translate
from dtgpt.config.user_words import UserWords
from dtgpt.data.indexed import DataError, DataFileNotFoundError
from dtgpt.error_once import print_error, print_error_once


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="train.py",
        description="Pretrain a GPT model. Override any config key with --section.key=value, or give "
        "Megatron-LM's flags (--num-layers 24 --fp16 ...; docs/megatron_flags.md).",
    )
    parser.add_argument("--config", help="TOML config file (default: built-in defaults)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as TOML and exit")
    parser.add_argument("--dry-run", action="store_true", help="plan the layout (memory, parameters) and exit")
    return parser.parse_known_args(argv)


NO_CONFIG = (
    "no --config given: name a config file, e.g. `python train.py --config configs/debug.toml` "
    "(`--print-config` alone shows the defaults)"
)


def run_main(argv: list[str], model_provider, datasets_provider) -> int:
    enable_crash_stacks()
    args, overrides = parse_args(argv)
    words = UserWords([])
    try:
        translated = translate(overrides)
        ignored = translated.ignored  # Megatron flags that change nothing here
        words = UserWords(translated.overrides, keys_in_file(args.config))
        if args.print_config:
            return print_config(args.config, overrides, ignored)
        if args.config is None and not overrides:
            raise ConfigError(NO_CONFIG)
        cfg = load_config(args.config, overrides)
        if cfg.logging.logging_level is not None:  # Megatron's --logging-level: the root logger's
            logging.getLogger().setLevel(cfg.logging.logging_level)
        taken = ""
        if cfg.checkpoint.use_checkpoint_args:
            from dtgpt.checkpoint.checkpoint_args import with_checkpoint_architecture

            cfg, taken = with_checkpoint_architecture(cfg)
        if args.dry_run:
            from dtgpt.plan import main as plan_main

            # Under torchrun (or with WORLD_SIZE set by hand) plan for that many ranks; else the
            # planner takes the smallest world the mesh allows (data_parallel_shard_size -1 as 1).
            world_size = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None
            return plan_main(cfg, world_size)
        print_start(cfg, args.config, taken)
        if ignored and os.environ.get("RANK", "0") == "0":
            print(ignored_note(ignored), flush=True)
        from dtgpt.training import pretrain

        pretrain(cfg, model_provider, datasets_provider)
        print_next_steps(cfg)
    except Exception as e:
        if not is_user_error(e):
            raise
        # Every rank exits 2; one says why (torchrun then adds its report of the failed workers:
        # dtgpt/error_once.py says why no worker can stop it).
        print_error_once(words.say(one_line(str(e))), command=" ".join(argv))
        return 2
    return 0


def enable_crash_stacks() -> None:
    """A rank that crashes in native code (a signal, not an exception) prints every thread's Python
    stack first: without it torchrun reports only the signal's number."""
    if faulthandler.is_enabled():
        return
    try:
        faulthandler.enable(all_threads=True)
    except (ValueError, OSError):  # stderr without a file descriptor (captured): nowhere to write
        pass


def exit_process(status: int) -> None:
    """End the process with `status` once its exit handlers have run (DataLoader workers stopped,
    logs flushed), skipping the interpreter's teardown. That teardown collects torch's millions of
    objects once more (1-3 s of CPU per rank), and then C++ destroys its static objects while
    gloo's threads may still run: a group lives on while anything holds it (in torch 2.13 a
    DTensor, through C++, holds its mesh's), and one rank in hundreds of runs crashed there
    (SIGSEGV) after a run that had finished."""
    # What the teardown does first: the threading exit hooks (an executor's idle workers, such as
    # the compiler's, are told to stop), then every non-daemon thread joined.
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def keys_in_file(path: str | None) -> set[str]:
    """The `section.key` names a config file sets: errors name these as keys, not as flags."""
    tables = load_toml(path).items() if path else ()
    return {f"{s}.{k}" for s, table in tables if isinstance(table, dict) for k in table}  # a stray top-level key: load_config names it


def print_start(cfg, path: str | None, architecture_from: str = "") -> None:
    """Rank 0's first line, at once: what is being built (the process group, the model and the
    data take a while before the start-up summary)."""
    if os.environ.get("RANK", "0") != "0":
        return
    m, world = cfg.model, os.environ.get("WORLD_SIZE", "1")
    print(
        f"> dtgpt: {path or 'the default config'} on {world} rank(s): building a GPT of {m.num_layers} layers, "
        f"hidden {m.hidden_size}, sequence {m.seq_length}{experts_text(m)}; then the data",
        flush=True,
    )
    if architecture_from:
        print(f"> {architecture_from}", flush=True)


def experts_text(m) -> str:
    """The mixture of experts of an MoE model, for the start-up lines ("" for a dense one)."""
    if not m.num_experts:
        return ""
    layers = sum(m.is_moe_layer(i) for i in range(m.num_layers))
    return f", {m.num_experts} experts (top-{m.moe_router_topk}) in {layers} of its layers"


def print_next_steps(cfg) -> None:
    """Rank 0's last line: where the run left its checkpoint and how to sample from it."""
    if os.environ.get("RANK", "0") != "0":
        return
    if cfg.checkpoint.save:
        print(
            f"> checkpoint in {cfg.checkpoint.save}; sample from it with: "
            f'{python_command()} scripts/generate.py {cfg.checkpoint.save} --prompt "def " --max-new-tokens 60 '
            "--temperature 0.8",
            flush=True,
        )
    else:
        print("> no checkpoint written (checkpoint.save is unset)", flush=True)


def python_command() -> str:
    """This interpreter as a user types it: `python` when it is the one on PATH (an activated
    venv), else its path (`.venv/bin/python` after `make train`), so the hint runs as printed."""
    on_path = shutil.which("python")
    if on_path and os.path.abspath(on_path) == os.path.abspath(sys.executable):
        return "python"
    relative = os.path.relpath(sys.executable)
    return sys.executable if relative.startswith("..") else relative


def print_config(path: str | None, overrides: list[str], ignored: list[str] = ()) -> int:
    """Print the resolved config as TOML, even one that does not validate yet (the defaults
    alone name no data); its first problem follows as an error line, and the exit code is 2.
    Ignored Megatron flags are named in a TOML comment first."""
    cfg = load_config(path, overrides, check=False)
    note = f"# {ignored_note(ignored)[2:]}\n" if ignored else ""
    print(note + to_toml(cfg), end="", flush=True)
    validate(cfg)
    return 0


def os_error_line(error: OSError) -> str:
    """An OSError as one line naming the path: `out.pt: Is a directory`."""
    return f"{error.filename}: {error.strerror}" if error.filename else str(error)


def is_user_error(error: BaseException) -> bool:
    """A bad file or checkpoint the user can fix: the error or one it was raised from
    (training re-raises errors naming the rank, phase and iteration)."""
    if isinstance(error, ConfigError):
        return True  # found before torch is imported
    from dtgpt.checkpoint.layout import CheckpointError  # torch is imported by now
    from dtgpt.training import SkippedTooOftenError

    while error is not None:
        if isinstance(error, (ConfigError, DataError, DataFileNotFoundError, CheckpointError, SkippedTooOftenError)):
            return True
        error = error.__cause__
    return False


def one_line(message: str) -> str:
    """A DataLoader worker's error arrives with the worker's traceback in its message: keep its
    last line, without the exception's class name."""
    if "Original Traceback" not in message:
        return message
    last = message.strip().splitlines()[-1]
    return last.split(": ", 1)[1] if ": " in last else last
