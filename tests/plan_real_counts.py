"""Test helper (run under torchrun): build the real model of a config on CPU and print, from
rank 0, one JSON list of {rank, pp_rank, dp_rank, tp_rank, local_params} for every rank.

    torchrun --nproc-per-node 8 tests/plan_real_counts.py --config F [--section.key=value ...]

tests/test_plan_ranks.py compares these counts with the planner's, which never allocates a weight.
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtgpt.config import load_config
from dtgpt.distributed import init_distributed, shutdown
from dtgpt.config import padded_vocab_size
from dtgpt.model import GPT
from dtgpt.parallel import build_model_parts
from dtgpt.plan import tokenizer_vocab_size


def main(argv: list[str]) -> None:
    cfg = load_config(argv[1], argv[2:]) if argv[0] == "--config" else load_config(None, argv)
    runtime = init_distributed(cfg)
    try:
        vocab = padded_vocab_size(tokenizer_vocab_size(cfg)[0], cfg.model.make_vocab_size_divisible_by)
        with torch.device("meta"):
            whole = GPT(cfg.model, vocab)
        model = build_model_parts(cfg, runtime.dims, whole, runtime.device)
        local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
        dims = runtime.dims
        row = {"rank": runtime.rank, "pp_rank": dims.pp_rank, "dp_rank": dims.dp_rank, "tp_rank": dims.tp_rank, "local_params": local}
        rows = [None] * runtime.world_size
        dist.all_gather_object(rows, row)
        if runtime.rank == 0:
            print(json.dumps(rows), flush=True)
    finally:
        shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
