"""Megatron-LM's own flags on train.py's command line: `--num-layers 96 --fp16 --data-path 0.3 a`.

One table maps each Megatron flag to a dtgpt key. It is derived: a config key is named as
Megatron's argument in snake_case, so a flag maps to the key of its name or of its argparse dest
(`--no-bias-gelu-fusion` stores False in bias_gelu_fusion); a `--no-X` flag that stores True sets
key X to False. RENAMED lists the few keys dtgpt names otherwise. Flags that only choose how
Megatron computes (kernels, fusions, overlap, logging extras) are accepted and listed in one
note (IGNORED); any other Megatron flag is refused by name, since dtgpt would silently train
something else. The flag list itself is dtgpt/config/megatron_names.py.

    python -m dtgpt.config.megatron_flags > docs/megatron_flags.md   # the documented table
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from functools import lru_cache
from typing import NamedTuple

from dtgpt.config.checkpoint_keys import EXIT_SIGNALS
from dtgpt.config.megatron_data_args import DATA_ARGS_PATH, PER_SPLIT_DATA_ARGS_PATH, data_args_overrides, toml_list
from dtgpt.config.megatron_names import MEGATRON_0_16_FLAGS, NEWER_FLAGS
from dtgpt.config.megatron_noted import EXAMPLE_SCRIPTS, NOTED, noted_section
from dtgpt.config.megatron_tested import NEWER as TESTED_NEWER
from dtgpt.config.megatron_tested import NOTED as TESTED_NOTED
from dtgpt.config.megatron_tested import TESTED_SCRIPTS, check_tested_value, tested_section
from dtgpt.config.megatron_vocab import padded_vocabulary_wins
from dtgpt.config.sections import Config, ConfigError

RENAMED = {
    "no-load-optim": ("checkpoint.load_optimizer", False),
    "distributed-backend": ("distributed.backend", None),
    "distributed-timeout-minutes": ("distributed.timeout_minutes", None),
    "timing-log-level": ("logging.timers_log_level", None),
    "ckpt-step": ("checkpoint.load_iteration", None),
    "num-virtual-stages-per-pipeline-rank": ("parallel.virtual_pipeline_stages_per_rank", None),
    "no-save-optim": ("checkpoint.save_optimizer", False),
    "no-check-for-nan-in-loss-and-grad": ("training.nan_policy", "skip"),
    "use-rotary-position-embeddings": ("model.position_embedding_type", "rope"),
    "padded-vocab-size": ("model.make_vocab_size_divisible_by", None),  # P rows: dtgpt/config/megatron_vocab.py
    "deterministic-mode": ("training.deterministic", True),
    "num-distributed-optimizer-instances": ("parallel.data_parallel_replicate_size", None),  # Megatron's HSDP replicas
    "recompute-activations": ("training.recompute_granularity", "selective"),
    "tiktoken-special-tokens": ("data.tokenizer_special_tokens", None),  # Megatron's older name of the flag
    "muon-use-nesterov": ("optimizer.muon_nesterov", True),  # core 0.16's name of --muon-nesterov
}
"""flag -> (dtgpt key, the value a flag without a value sets (a bool or a string); None: the flag takes values)."""

GRAD_DTYPE_KEY = "training.grad_reduce_in_bf16"
GRAD_DTYPE = {"fp32": "false", "bf16": "true", "auto": None}
CHOICES = {
    "no-weight-decay-cond-type": ("optimizer.apply_wd_to_qk_layernorm", {"apply_wd_to_qk_layernorm": "true"}),
    # Megatron-FSDP's gradient accumulation and reduce-scatter dtypes: dtgpt has one for both, so two
    # different values are the error of two settings of one key (CONFLICT_WORDS)
    "megatron-fsdp-main-grads-dtype": (GRAD_DTYPE_KEY, GRAD_DTYPE),
    "megatron-fsdp-grad-comm-dtype": (GRAD_DTYPE_KEY, GRAD_DTYPE),
    "exit-signal": ("checkpoint.exit_signal", {name: name for name in EXIT_SIGNALS}),
}
"""flag -> (dtgpt key, each value Megatron accepts -> the key's value, None: the value sets nothing and is
noted): a flag whose value names a setting."""

FROM_FILE = (DATA_ARGS_PATH, PER_SPLIT_DATA_ARGS_PATH)
"""Flags naming a file whose contents are the values of data keys (dtgpt/config/megatron_data_args.py)."""

WHY_REFUSED = {
    "model-parallel-size": "Megatron-LM refuses it too (its old name of the tensor-parallel size): give --tensor-model-parallel-size",
    "full-validation": "dtgpt evaluates --eval-iters global batches of the validation split, not the whole split; "
    "give --eval-iters",
    "multiple-validation-sets": "dtgpt evaluates one validation set (one blend of the --valid-data-path datasets); "
    "give one blend",
}
"""flag -> why it is refused, where a reason says more than "not implemented"."""

CONFLICT_WORDS = {
    GRAD_DTYPE_KEY: "ask for different gradient dtypes: dtgpt accumulates and reduces gradients in one dtype "
    "(fp32, or bf16 under --bf16); give one",
}
"""key -> what two command-line settings that give it different values are told, where the key's
own values (true, false) would not say it (dtgpt/config/loading.py)."""

IGNORED = (
    "use-mcore-models", "transformer-impl", "use-flash-attn", "attention-backend",
    "no-masked-softmax-fusion", "no-bias-dropout-fusion", "no-bias-swiglu-fusion", "no-rope-fusion",
    "no-persist-layer-norm", "no-gradient-accumulation-fusion", "attention-softmax-in-fp32",
    "cross-entropy-loss-fusion", "cross-entropy-fusion-impl", "use-distributed-optimizer",
    "overlap-grad-reduce", "overlap-param-gather", "use-torch-fsdp2", "tp-comm-overlap",
    "no-async-tensor-model-parallel-allreduce", "use-cpu-initialization", "empty-unused-memory-level",
    "manual-gc", "manual-gc-interval", "dataloader-type", "no-mmap-bin-files",
    "no-create-attention-mask-in-dataloader", "ckpt-format", "ckpt-fully-parallel-load",
    "ckpt-assume-constant-structure", "use-dist-ckpt", "dist-ckpt-format", "log-throughput", "log-timers-to-tensorboard",
    "log-validation-ppl-to-tensorboard", "log-memory-to-tensorboard", "log-params-norm",
    "log-num-zeros-in-grad", "no-log-loss-scale-to-tensorboard", "disable-log-loss-scale-to-tensorboard",
    "log-world-size-to-tensorboard", "log-memory-interval", "tensorboard-log-interval",
    "tensorboard-queue-size", "profile", "use-pytorch-profiler",
    "moe-permute-fusion", "moe-router-fusion", "moe-shared-expert-overlap",
    *NOTED,  # Megatron's example scripts' flags, each with what dtgpt does (dtgpt/config/megatron_noted.py)
    *TESTED_NOTED,  # Megatron's functional tests' flags, each with what dtgpt does (dtgpt/config/megatron_tested.py)
)  # fmt: skip
"""Megatron internals with no effect on what dtgpt trains: accepted with one note on rank 0."""

DTGPT_OPTIONS = ("--config", "--print-config", "--dry-run")


class Flag(NamedTuple):
    name: str  # without the dashes
    dest: str
    arity: str  # "0": no value; "1": one; "*": one or more; "3": exactly three
    stores: bool | None  # what a flag without a value stores


class Mapping(NamedTuple):
    flag: Flag
    key: str  # section.key
    value: bool | str | None  # what the flag sets, for a flag without a value


@lru_cache(maxsize=None)
def megatron_flags() -> dict[str, Flag]:
    """Megatron's flags by name, read from the packed list of dtgpt/config/megatron_names.py."""
    flags = {}
    for entry in (MEGATRON_0_16_FLAGS + NEWER_FLAGS + TESTED_NEWER).split():
        spec, _, dest = entry.partition("=")
        name, stores, arity = spec, None, "1"
        if spec[-1] in "!~":
            name, stores, arity = spec[:-1], spec[-1] == "!", "0"
        elif spec.endswith("*"):
            name, arity = spec[:-1], "*"
        elif ":" in spec:
            name, arity = spec.split(":")
        flags[name] = Flag(name, dest or name.replace("-", "_"), arity, stores)
    return flags


def _config_keys() -> dict[str, str]:
    """Each key name -> section.key (key names are unique across sections)."""
    return {
        f.name: f"{section.name}.{f.name}"
        for section in dataclasses.fields(Config)
        for f in dataclasses.fields(section.default_factory)  # type: ignore[arg-type]
    }


@lru_cache(maxsize=None)
def flag_table() -> dict[str, Mapping]:
    """Every Megatron flag that sets a dtgpt key, by name: the one table."""
    keys, table = _config_keys(), {}
    for flag in megatron_flags().values():
        if flag.name in RENAMED:
            key, value = RENAMED[flag.name]
        elif flag.name in CHOICES:
            key, value = CHOICES[flag.name][0], None
        elif flag.name.replace("-", "_") in keys or flag.dest in keys:
            key = keys.get(flag.name.replace("-", "_")) or keys[flag.dest]
            value = flag.stores
        elif flag.name.startswith("no-") and flag.stores and flag.name[3:].replace("-", "_") in keys:
            key, value = keys[flag.name[3:].replace("-", "_")], False
        else:
            continue
        table[flag.name] = Mapping(flag, key, value)
    return table


class Translated(NamedTuple):
    overrides: list[tuple[str, str, str]]  # (section.key, value as text, how the user spelled it)
    ignored: list[str]  # Megatron flags accepted without effect


def translate(args: list[str]) -> Translated:
    """Split the command line after train.py's own options into `--section.key=value` overrides
    and Megatron flags, the flags turned into overrides of their dtgpt keys."""
    overrides, ignored, i = [], [], 0
    while i < len(args):
        arg = args[i]
        name, has_value, inline = arg[2:].partition("=") if arg.startswith("--") else (arg, "", "")
        if arg.startswith("--") and "." in name:  # a dtgpt override: --section.key=value or --section.key value
            if not has_value and i + 1 >= len(args):
                raise ConfigError(f"override {arg} has no value")
            value = inline if has_value else args[i + 1]
            overrides.append((name, value, f"{arg}" if has_value else f"{arg} {value}"))
            i += 1 if has_value else 2
            continue
        flag = megatron_flags().get(name) if arg.startswith("--") else None
        if flag is None:
            raise ConfigError(_unknown(arg))
        values = [inline] if has_value else []
        i += 1
        wanted = 0 if has_value else {"0": 0, "1": 1, "*": len(args)}.get(flag.arity) or int(flag.arity)
        while len(values) < wanted and i < len(args) and not args[i].startswith("--"):
            values.append(args[i])
            i += 1
        _check_arity(arg, flag, values)
        check_tested_value(name, values)
        if name in FROM_FILE:
            overrides.extend(data_args_overrides(name, values[0]))
        elif name in IGNORED:
            ignored.append(" ".join(["--" + name, *values]))
        elif name in flag_table():
            mapping = flag_table()[name]
            text = _as_text(mapping, values)
            if text is None:  # a choice that keeps dtgpt's default
                ignored.append(" ".join(["--" + name, *values]))
            else:
                overrides.append((mapping.key, text, " ".join(["--" + name, *values])))
        elif name in WHY_REFUSED:
            raise ConfigError(f"--{name} is refused: {WHY_REFUSED[name]}")
        else:
            raise ConfigError(f"--{name} is a Megatron-LM flag dtgpt does not implement (docs/megatron_flags.md lists the ones it maps)")
    return Translated(padded_vocabulary_wins(overrides), ignored)


def _check_arity(arg: str, flag: Flag, values: list[str]) -> None:
    if flag.arity == "0" and values:
        raise ConfigError(f"{arg}: --{flag.name} takes no value")
    if flag.arity in "1*" and not values:
        raise ConfigError(f"--{flag.name} needs a value")
    if flag.arity.isdigit() and flag.arity not in "01" and len(values) != int(flag.arity):
        raise ConfigError(f"--{flag.name} needs {flag.arity} values, got {len(values)}")


def _as_text(mapping: Mapping, values: list[str]) -> str | None:
    """The override text of a flag's values: a TOML list for a list key, so that a path holding
    a comma or a space stays one element."""
    if mapping.flag.arity == "0":
        return mapping.value if isinstance(mapping.value, str) else "true" if mapping.value else "false"
    if mapping.flag.name in CHOICES:
        choices = CHOICES[mapping.flag.name][1]
        if values[0] not in choices:
            raise ConfigError(f"--{mapping.flag.name}={values[0]} is not one of Megatron's values: {', '.join(choices)}")
        return choices[values[0]]
    if mapping.flag.arity == "1":
        return values[0]
    if _key_type(mapping.key) in (list[str], typing.Optional[list[str]]):
        return toml_list(values)
    return " ".join(values)


def _key_type(dotted: str):
    section, key = dotted.split(".")
    section_cls = {f.name: f.default_factory for f in dataclasses.fields(Config)}[section]
    return typing.get_type_hints(section_cls)[key]


def _unknown(arg: str) -> str:
    if not arg.startswith("--"):
        return f"unexpected argument {arg!r}; overrides look like --section.key=value"
    known = [*DTGPT_OPTIONS, *("--" + n for n in (*flag_table(), *IGNORED, *FROM_FILE))]
    match = difflib.get_close_matches(arg.split("=")[0], known, n=1, cutoff=0.6)
    hint = f"did you mean '{match[0]}'?" if match else "overrides look like --section.key=value, or Megatron-LM's flags"
    return f"unexpected argument {arg!r}; {hint}"


def ignored_note(ignored: list[str]) -> str:
    """The one line rank 0 prints for the Megatron flags that change nothing in dtgpt."""
    return f"> ignoring Megatron-LM flags that choose only Megatron's internals: {' '.join(ignored)}"


def markdown_table() -> str:
    """docs/megatron_flags.md: every flag dtgpt maps, then the ones it ignores."""
    lines = [
        "# Megatron-LM flags on train.py",
        "",
        "`train.py` takes Megatron-LM's flags as written in a Megatron launch script, mixed freely with",
        "`--config` and `--section.key=value`. Each sets the dtgpt key below (a flag without a value sets",
        "the value shown). Where a Megatron flag and another command-line setting name one key with",
        "different values, that is an error; the command line beats the config file, and a command-line",
        "choice resets the file's competing keys (the data source, the warmup length, fp16 against bf16).",
        "The flags listed last only choose Megatron's kernels, fusions or logging extras: they are",
        "accepted with one note. Any other Megatron flag is refused by name.",
        "",
        "The vocabulary: Megatron pads it to `--make-vocab-size-divisible-by` (default 128) times the",
        "tensor-parallel size, dtgpt's `model.make_vocab_size_divisible_by` is the whole multiple (so the",
        "model does not depend on the mesh it later runs on). The flag keeps Megatron's meaning: it sets the",
        "key to its value x tp when the config is read, and a command line of Megatron flags without",
        "`--config` takes Megatron's default, 128 x tp (the 175B script: 1024, 51,200 rows). A config",
        "file's or a `--model.make_vocab_size_divisible_by` value is the whole multiple",
        "(dtgpt/config/megatron_vocab.py).",
        "",
        "Generated by `python -m dtgpt.config.megatron_flags > docs/megatron_flags.md`;",
        "tests/test_megatron_flags.py checks it is current.",
        "",
        "| Megatron flag | dtgpt key | sets |",
        "|---|---|---|",
    ]
    for name, m in sorted(flag_table().items(), key=lambda item: (item[1].key, item[0])):
        if name in CHOICES:
            sets = "; ".join(f"{v}: {'nothing' if t is None else t}" for v, t in CHOICES[name][1].items())
            lines.append(f"| `--{name}` | `{m.key}` | {sets} |")
            continue
        arity = {"0": m.value if isinstance(m.value, str) else str(m.value).lower(), "1": "its value", "*": "its values (a list)"}.get(m.flag.arity, f"its {m.flag.arity} values (a list)")
        lines.append(f"| `--{name}` | `{m.key}` | {arity} |")
    lines += ["", f"Read from a file (docs/data.md): `--{DATA_ARGS_PATH}` sets `data.data_path` to the file's words, "
              f"`--{PER_SPLIT_DATA_ARGS_PATH}` sets `data.train_data_path`, `data.valid_data_path` and "
              "`data.test_data_path` from its JSON object's \"train\", \"valid\" and \"test\"."]  # fmt: skip
    lines += ["", "Refused, with the reason:", "", *(f"- `--{name}`: {why}." for name, why in WHY_REFUSED.items())]
    lines += ["", "Accepted and ignored (with a note):", "", ", ".join(f"`--{n}`" for n in IGNORED), ""]
    lines += ["## Megatron's example scripts", "", *EXAMPLE_SCRIPTS, "", *noted_section(), ""]
    lines += ["## Megatron's functional tests", "", *TESTED_SCRIPTS, "", *tested_section(), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table(), end="")
