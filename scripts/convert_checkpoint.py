"""Convert checkpoints between dtgpt's DCP layout, one torch.save file, Hugging Face and Megatron-LM.

    python scripts/convert_checkpoint.py to-torch  CKPT out.pt [--iteration N] [--weights-only]
    python scripts/convert_checkpoint.py to-hf     CKPT out_dir/ [--iteration N]   (model + tokenizer)
    python scripts/convert_checkpoint.py from-torch in.pt NEW_CKPT_DIR [--config run.toml]
    python scripts/convert_checkpoint.py from-hf   hf_dir/ NEW_CKPT_DIR [--config run.toml]
    python scripts/convert_checkpoint.py to-megatron   CKPT MEGATRON_DIR [--tp N]   (Megatron-LM torch_dist)
    python scripts/convert_checkpoint.py from-megatron MEGATRON_DIR NEW_CKPT_DIR --config run.toml

to-hf writes GPT2LMHeadModel for a GPT-3-style model (learned positions, LayerNorm, GeLU),
LlamaForCausalLM for a Llama-style one (RoPE, RMSNorm, SwiGLU) and DeepseekV3ForCausalLM for a
DeepSeek-V3-style one (multi-latent attention, MoE, prediction modules); from-hf reads each.
to-gpt2 and from-gpt2 are their earlier names.

CKPT is a checkpoint root (the pointer is followed) or one iter_XXXXXXX directory, saved on any
mesh. Each from-* command prints the command that trains on from what it wrote (its stored config,
`--checkpoint.load=NEW_CKPT_DIR --checkpoint.save=NEW_CKPT_DIR --checkpoint.load_optimizer=false`:
the weights, and the iteration and consumed samples where the source had them); a to-torch
file of a whole checkpoint converts back to one that also resumes the optimizer and progress.
Runs in one process; no process group is needed. The Megatron conversions stream one tensor at
a time (docs/checkpoints.md); `checkpoint.load` also reads a Megatron directory directly.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from dtgpt.checkpoint import CheckpointError, layout, megatron  # noqa: E402
from dtgpt.checkpoint.saved_config import read_saved_config  # noqa: E402
from dtgpt.checkpoint.stored import stored_optimizer  # noqa: E402
from dtgpt.checkpoint.export import (  # noqa: E402
    find_checkpoint,
    from_hf_dir,
    from_torch_file,
    read_config,
    to_hf_dir,
    to_torch_file,
)
from dtgpt.cli import os_error_line, print_error  # noqa: E402
from dtgpt.config import Config, ConfigError, load_config, padded_vocabulary  # noqa: E402
from dtgpt.data.tokenizer import build_tokenizer  # noqa: E402


ALIASES = {"to-gpt2": "to-hf", "from-gpt2": "from-hf"}


def train_hint(root: str, directory: Path) -> str:
    """The command that trains on from a converted checkpoint, runnable as printed: the model and
    tokenizer of the config stored with it, its iteration and consumed samples (where the source
    had them), fresh AdamW state and LR schedule, and its saves beside the converted iteration."""
    config = Path(directory) / layout.CONFIG
    placeholder = read_saved_config(config).data.mock_data
    data = " (it trains on mock data: add --data.data_path=PREFIX for your corpus)" if placeholder else ""
    return (f"train from it with: python train.py --config {shlex.quote(str(config))} --checkpoint.load={shlex.quote(root)} "
            f"--checkpoint.save={shlex.quote(root)} --checkpoint.load_optimizer=false{data}")


def to_hf(args) -> None:
    directory = find_checkpoint(args.src, args.iteration)
    architecture, written = to_hf_dir(directory, read_config(directory, args.config), args.dst)
    print(f"wrote {args.dst} ({architecture}): {', '.join(written)} from {directory} (padded vocabulary rows kept)")


def from_hf(args) -> None:
    cfg = load_config(args.config) if args.config else Config()
    directory, summary = from_hf_dir(args.src, args.dst, cfg, args.iteration or 0)
    print(f"wrote {directory} ({summary}); {train_hint(args.dst, directory)}")


def to_megatron(args) -> None:
    if args.tp < 1:  # a ZeroDivisionError at 0, a vocabulary "padded for tp -2" below
        raise ValueError(f"--tp {args.tp} must be 1 or more")
    directory = find_checkpoint(args.src, args.iteration)
    cfg = read_config(directory, args.config)
    if args.format == "per-rank":
        written = megatron.to_megatron_per_rank(directory, cfg, args.dst, args.tp, args.ep, args.pp,
                                                args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers)
        print(f"wrote {written} (Megatron-LM per-rank files of tp {args.tp} x pp {args.pp} x ep {args.ep}) from {directory}")
        return
    if args.pp != 1 or args.decoder_first_pipeline_num_layers is not None or args.decoder_last_pipeline_num_layers is not None:
        raise ValueError("--pp names the per-rank format's pipeline stages: torch_dist is the same at any pp (add --format per-rank)")
    if args.ep != 1:
        raise ValueError("--ep names the per-rank format's expert-parallel files: torch_dist is the same at any ep (add --format per-rank)")
    written = megatron.to_megatron(directory, cfg, args.dst, args.tp)
    sgd = stored_optimizer(layout.read_metadata(directory)) == "sgd"
    left_out = "; its SGD momentum is left out (to-megatron writes Adam's and Muon's state)" if sgd else ""
    print(f"wrote {written} (Megatron-LM torch_dist, vocabulary padded for tp {args.tp}) from {directory}{left_out}")


def from_megatron(args) -> None:
    if not args.config:
        raise ConfigError(
            "from-megatron needs --config: a dtgpt TOML of the run's model and tokenizer (a dtgpt checkpoint's "
            "iter_*/config.toml works, or one of configs/; Megatron's args are not a dtgpt config)"
        )
    cfg = load_config(args.config)
    rows = padded_vocabulary(cfg, build_tokenizer(cfg.data).vocab_size)
    written = megatron.from_megatron(args.src, cfg, args.dst, rows)
    print(f"wrote {written}; {train_hint(args.dst, written)}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = ("to-torch", "to-hf", "from-torch", "from-hf", "to-megatron", "from-megatron", *ALIASES)
    parser.add_argument("command", choices=commands)
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--iteration", type=int, default=0, help="iteration to read (default: the pointer's) or to write")
    parser.add_argument("--config", help="TOML config (default: the one stored with the checkpoint)")
    parser.add_argument("--tp", type=int, default=1, help="to-megatron: pad the vocabulary as Megatron does at this tensor parallel size")
    parser.add_argument("--format", choices=("torch_dist", "per-rank"), default="torch_dist",
                        help="to-megatron: Megatron's torch_dist (any mesh) or its per-rank mp_rank_TT[_PPP][_EEE] files")
    parser.add_argument("--ep", type=int, default=1, help="to-megatron --format per-rank: expert parallel size of the files")
    parser.add_argument("--pp", type=int, default=1, help="to-megatron --format per-rank: pipeline parallel size of the files")
    parser.add_argument("--decoder-first-pipeline-num-layers", type=int,
                        help="to-megatron --format per-rank --pp N: layers of the first stage (Megatron's flag), the rest split evenly")
    parser.add_argument("--decoder-last-pipeline-num-layers", type=int,
                        help="to-megatron --format per-rank --pp N: layers of the last stage (Megatron's flag), the rest split evenly")
    parser.add_argument("--weights-only", action="store_true", help="to-torch: model tensors only")
    args = parser.parse_args(argv)
    args.command = ALIASES.get(args.command, args.command)
    try:
        if args.command == "to-torch":
            directory = find_checkpoint(args.src, args.iteration)
            to_torch_file(directory, args.dst, weights_only=args.weights_only)
            print(f"wrote {args.dst} from {directory}")
        elif args.command == "to-hf":
            to_hf(args)
        elif args.command == "from-torch":
            directory = from_torch_file(args.src, args.dst, args.config, args.iteration or None)
            print(f"wrote {directory}; {train_hint(args.dst, directory)}")
        elif args.command == "to-megatron":
            to_megatron(args)
        elif args.command == "from-megatron":
            from_megatron(args)
        else:
            from_hf(args)
    except (CheckpointError, ConfigError, ValueError, KeyError) as e:
        print_error(str(e))
        return 2
    except OSError as e:  # an output path that is a directory or not writable, a missing input
        print_error(os_error_line(e))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
