"""Pretrain GPT, as Megatron-LM's pretrain_gpt.py does: name the providers, call pretrain().

    python train.py --config configs/debug.toml                       # one process
    torchrun --nproc-per-node 8 train.py --config configs/debug_3d.toml
    python train.py --config configs/gpt3_175b.toml --print-config    # the resolved TOML
    python train.py --config configs/gpt3_175b.toml --dry-run         # plan the layout, no training

Any key can be overridden: --training.train_iters=20 or --training.train_iters 20.
"""

import sys

from dtgpt.cli import exit_process, run_main
from dtgpt.config import Config
from dtgpt.data import build_datasets
from dtgpt.model import GPT


def model_provider(cfg: Config, vocab_size: int) -> GPT:
    """The GPT of cfg.model with a padded vocabulary (called on the meta device)."""
    return GPT(cfg.model, vocab_size)


def datasets_provider(cfg: Config, tokenizer, num_samples: tuple[int, int, int]):
    """Train, validation and test datasets of the requested sample counts."""
    return build_datasets(cfg, tokenizer, num_samples)


if __name__ == "__main__":  # async checkpoint saves re-import this file in worker processes
    exit_process(run_main(sys.argv[1:], model_provider, datasets_provider))  # (dtgpt/cli.py: why not sys.exit)
