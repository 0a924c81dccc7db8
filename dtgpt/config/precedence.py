"""Keys that cannot both hold: the command line wins over the file, and a tie is an error.

Some choices exclude each other: the source of the training data (mock data, the built-in
corpus, a blend of prefixes, per-split prefixes), the length of the LR warmup (a fraction, in
iterations or in samples), fp16 against bf16, and the built-in corpus against a tokenizer other than the byte
tokenizer it was built with. A user who runs a config file with
`--data.data_path=...` means "this data instead"; so a choice made on the command line resets
the file's competing keys to their defaults. Two competing choices made in the same place (both
in the file, both on the command line, or both in `make_config`) are refused with one line that
names both keys.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from dtgpt.config.batch_schedule import STEP_KEY, step_schedule
from dtgpt.config.sections import Config, ConfigError

DEFAULT, FILE, COMMAND_LINE = 0, 1, 2
WHERE = {FILE: "the config file", COMMAND_LINE: "the command line"}

EXCLUSIVE_CHOICES = (
    (  # where the training data comes from
        ("data.mock_data",),
        ("data.builtin_corpus",),
        ("data.data_path",),
        ("data.train_data_path", "data.valid_data_path", "data.test_data_path"),
    ),
    (  # how long the run is
        ("training.train_iters",),
        ("training.train_samples",),
    ),
    (  # how long the LR warmup is
        ("optimizer.lr_warmup_fraction",),
        ("optimizer.lr_warmup_iters",),
        ("optimizer.lr_warmup_samples",),
    ),
    (  # the low precision the model computes in (Megatron's --fp16 / --bf16)
        ("training.fp16",),
        ("training.bf16",),
    ),
)
"""Each group lists the ways of saying one thing; at most one way per group may be used. A key
is used when it differs from its default."""

GLOBAL_BATCH = "training.global_batch_size"
BYTE_TOKENIZER = "ByteTokenizer"
TOKENIZER_FILES = ("data.vocab_file", "data.merge_file", "data.tokenizer_model")


def _default(dotted: str):
    section, key = dotted.split(".")
    section_cls = {f.name: f.default_factory for f in dataclasses.fields(Config)}[section]
    f = next(f for f in dataclasses.fields(section_cls) if f.name == key)
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _get(cfg: Config, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def _reset(cfg: Config, dotted: str, value=None) -> None:
    section, key = dotted.split(".")
    setattr(getattr(cfg, section), key, _default(dotted) if value is None else value)


def _is_set(cfg: Config, keys: tuple[str, ...]) -> bool:
    return any(_get(cfg, k) != _default(k) for k in keys)


def _level(levels: dict[str, int], keys: Iterable[str]) -> int:
    return max(levels.get(k, DEFAULT) for k in keys)


def _refuse(cfg: Config, a: str, b: str, where: int) -> None:
    place = WHERE.get(where, "make_config")
    raise ConfigError(
        f"{a}={_get(cfg, a)!r} and {b}={_get(cfg, b)!r} cannot both be set ({place} sets both); keep one"
    )


def _one_choice(cfg: Config, levels: dict[str, int], group: tuple[tuple[str, ...], ...]) -> None:
    chosen = [keys for keys in group if _is_set(cfg, keys)]
    if len(chosen) < 2:
        return
    top = max(_level(levels, keys) for keys in chosen)
    winners = [keys for keys in chosen if _level(levels, keys) == top]
    if len(winners) > 1:
        first, second = (next(k for k in keys if _is_set(cfg, (k,))) for keys in winners[:2])
        _refuse(cfg, first, second, top)
    for keys in chosen:
        if keys is not winners[0]:
            for k in keys:
                _reset(cfg, k)


def _builtin_tokenizer(cfg: Config, levels: dict[str, int]) -> None:
    """The built-in corpus is stored byte-tokenized: it implies the byte tokenizer."""
    if not cfg.data.builtin_corpus:
        return
    corpus = levels.get("data.builtin_corpus", DEFAULT)
    rivals = [k for k in TOKENIZER_FILES if _get(cfg, k)]
    if cfg.data.tokenizer_type != BYTE_TOKENIZER and levels.get("data.tokenizer_type", DEFAULT) > DEFAULT:
        rivals.append("data.tokenizer_type")
    for key in rivals:
        level = levels.get(key, DEFAULT)
        if level == corpus:
            _refuse(cfg, "data.builtin_corpus", key, level)
        if level > corpus:  # the command line chose a tokenizer: the file's corpus gives way
            _reset(cfg, "data.builtin_corpus")
            return
    for key in rivals:
        _reset(cfg, key)
    cfg.data.tokenizer_type = BYTE_TOKENIZER


def _schedule_sets_global_batch(cfg: Config, levels: dict[str, int]) -> None:
    """A step schedule sets the global batch (its last batch size; Megatron refuses an explicit
    --global-batch-size beside it): a global_batch_size from a lower place gives way, one from a
    higher place replaces the schedule, and two that disagree in one place are refused."""
    t = cfg.training
    if not t.step_batch_size_schedule:
        return
    last = step_schedule(t, cfg.model.seq_length)[-1][1]
    batch, schedule = levels.get(GLOBAL_BATCH, DEFAULT), levels.get(STEP_KEY, DEFAULT)
    if t.global_batch_size == last or batch < schedule:
        t.global_batch_size = last
    elif batch > schedule:
        _reset(cfg, STEP_KEY)
    else:
        _refuse(cfg, STEP_KEY, GLOBAL_BATCH, batch)


def resolve_conflicts(cfg: Config, levels: dict[str, int]) -> None:
    """Apply the rules above in place; `levels` says where each key was set (FILE or
    COMMAND_LINE); a key not in it has its default."""
    for group in EXCLUSIVE_CHOICES:
        _one_choice(cfg, levels, group)
    _builtin_tokenizer(cfg, levels)
    _schedule_sets_global_batch(cfg, levels)


def check_conflicts(cfg: Config) -> None:
    """Validation's view, where nobody says which key came from where: every key that differs
    from its default counts as set in one place, so any competing pair is refused."""
    keys = [k for group in EXCLUSIVE_CHOICES for keys in group for k in keys]
    keys += ["data.tokenizer_type", *TOKENIZER_FILES, GLOBAL_BATCH, STEP_KEY]
    scratch = dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data),
        optimizer=dataclasses.replace(cfg.optimizer),
        training=dataclasses.replace(cfg.training),
    )  # resolve_conflicts works in place: let it work on a copy
    resolve_conflicts(scratch, {k: FILE for k in keys if _is_set(cfg, (k,))})
