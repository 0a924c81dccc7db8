"""Sample text from a checkpoint, on one process, whatever mesh saved it.

    python scripts/generate.py CKPT --prompt "Once upon a time" --max-new-tokens 50 \
        --temperature 0.8 --top-k 40 [--iteration N] [--config run.toml] [--seed 0]

CKPT is a checkpoint root (the pointer is followed) or one iter_XXXXXXX directory. The tokenizer
is the one of the config stored with the checkpoint (or --config). With NullTokenizer the prompt
is token ids separated by spaces. --temperature 0 picks the most likely token (greedy).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from dtgpt.checkpoint import CheckpointError  # noqa: E402
from dtgpt.checkpoint.export import find_checkpoint, load_model, read_config  # noqa: E402
from dtgpt.cli import os_error_line, print_error  # noqa: E402
from dtgpt.config import ConfigError  # noqa: E402
from dtgpt.data import build_tokenizer  # noqa: E402
from dtgpt.model import GPT  # noqa: E402


@torch.no_grad()
def sample(
    model: GPT, ids: list[int], max_new_tokens: int, temperature: float, top_k: int, vocab: int, generator: torch.Generator
) -> list[int]:
    """Append max_new_tokens sampled tokens to ids; never a padded-vocabulary id (>= vocab)."""
    tokens = torch.tensor([ids], dtype=torch.long)
    window = model.cfg.max_positions
    for _ in range(max_new_tokens):
        logits = model(tokens[:, -window:])[0, -1, :vocab].float()  # (V,)
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if 0 < top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))
        tokens = torch.cat([tokens, torch.tensor([[nxt]])], dim=1)
    return tokens[0].tolist()


def argument_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the sampling arguments, as one line; None when they make sense."""
    if args.max_new_tokens < 0:
        return f"--max-new-tokens={args.max_new_tokens} must be >= 0"
    if not math.isfinite(args.temperature) or args.temperature < 0:
        return f"--temperature={args.temperature} must be a finite number >= 0 (0: greedy)"
    if args.top_k < 0:
        return f"--top-k={args.top_k} must be >= 0 (0: every token)"
    if args.iteration < 0:
        return f"--iteration={args.iteration} must be >= 0 (0: the newest checkpoint)"
    if not 0 <= args.seed < 2**63:
        return f"--seed={args.seed} must be in [0, 2**63)"
    return None


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt's token ids (eod alone for no prompt); a prompt the tokenizer refuses (a
    NullTokenizer's text is its ids) is one error naming it."""
    if not prompt:
        return [tokenizer.eod]
    try:
        return tokenizer.tokenize(prompt)
    except ValueError as e:
        raise ValueError(f"--prompt {prompt!r}: {e}") from None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--prompt", default="")
    parser.add_argument("--max-new-tokens", type=int, default=50)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    parser.add_argument("--iteration", type=int, default=0)
    parser.add_argument("--config", help="TOML config (default: the one stored with the checkpoint)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    problem = argument_problem(args)
    if problem:
        print_error(problem)
        return 2
    try:
        directory = find_checkpoint(args.checkpoint, args.iteration)
        cfg = read_config(directory, args.config)
        tokenizer = build_tokenizer(cfg.data)
        ids = prompt_ids(tokenizer, args.prompt)
        model = load_model(directory, cfg)
    except (CheckpointError, ConfigError, ValueError) as e:
        print_error(str(e))
        return 2
    except OSError as e:
        print_error(os_error_line(e))
        return 2
    model.eval()
    out = sample(model, ids, args.max_new_tokens, args.temperature, args.top_k, tokenizer.vocab_size,
                 torch.Generator().manual_seed(args.seed))  # fmt: skip
    print(f"> {directory}: {args.max_new_tokens} tokens, temperature {args.temperature}, top-k {args.top_k}", file=sys.stderr)
    print(tokenizer.detokenize(out if args.prompt else out[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
