"""checkpoint.use_checkpoint_args: the model's architecture taken from the checkpoint to load
(Megatron-LM's --use-checkpoint-args), before anything is built.

A Megatron-LM checkpoint gives it from its args (common.pt), and its tokenizer type, model and
tiktoken pattern as Megatron's own load takes them (tokenizer_args.py); a dtgpt one from its saved
config. The other [model] keys (dropout, the RNG of dropout, sequence length) stay the config's.
"""

from __future__ import annotations

import dataclasses

from dtgpt.checkpoint import layout, megatron
from dtgpt.checkpoint.architecture import with_architecture_of, with_megatron_architecture
from dtgpt.checkpoint.megatron.reader import MegatronReader
from dtgpt.checkpoint.resume_controls import pretrained_start, resume_root
from dtgpt.checkpoint.tokenizer_args import with_megatron_tokenizer
from dtgpt.config import Config, ConfigError, validate
from dtgpt.config.sections import require


def with_checkpoint_architecture(cfg: Config) -> tuple[Config, str]:
    """(cfg with the checkpoint's architecture, a line for the log saying where it came from);
    cfg unchanged when there is no checkpoint yet to resume (auto_resume's first run). While the load
    directory holds none, checkpoint.pretrained_checkpoint's architecture is taken, as Megatron takes it."""
    c = pretrained_start(cfg).checkpoint
    root = resume_root(c)
    require(bool(root), "checkpoint.use_checkpoint_args=true needs checkpoint.load (or checkpoint.pretrained_checkpoint): "
            "the checkpoint whose architecture to take")
    directory = megatron.find(root, c.load_iteration)
    if directory is not None:
        args = MegatronReader(directory).common.get("args")
        require(args is not None, f"checkpoint.use_checkpoint_args=true: Megatron checkpoint {directory} stores no args (no common.pt)")
        model = with_megatron_architecture(args, cfg.model)
        cfg, tokenizer_keys = with_megatron_tokenizer(args, cfg)
    else:
        root, iteration, _ = layout.load_root(root, c.load_iteration)
        found = layout.resolve(root, iteration, fresh_ok=c.auto_resume, trust_pickles=c.trust_pickles)
        if found.directory is None:
            return cfg, ""
        saved = layout.stored_config(found.directory)
        if saved is None:
            raise ConfigError(f"checkpoint.use_checkpoint_args=true: {found.directory} has no readable {layout.CONFIG}")
        directory, model = found.directory, with_architecture_of(saved.model, cfg.model)
        tokenizer_keys = []
    taken = dataclasses.replace(cfg, model=model)
    try:
        validate(taken)
    except ConfigError as e:
        raise ConfigError(f"checkpoint.use_checkpoint_args=true: the architecture of {directory}: {e}") from None
    also = f", and {', '.join(tokenizer_keys)}" if tokenizer_keys else ""
    return taken, f"the model's architecture is {directory}'s{also} (checkpoint.use_checkpoint_args)"
