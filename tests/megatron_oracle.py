"""megatron-core (the pinned `dev` extra) as the oracle for dtgpt's data order.

Builds megatron-core's own GPTDataset / BlendedDataset through BlendedMegatronDatasetBuilder, as
Megatron-LM's pretrain_gpt.py does, on indexed datasets written by dtgpt's writer. No patch is
needed on CPU: its C++ helpers ship prebuilt in the wheel, and the only distributed call
(BlendedDataset asks for the rank before writing its cache) is answered by a 1-rank gloo group
that lives only while the builder runs. megatron-core is imported at the top on purpose: without
it these tests fail instead of skipping.
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional

import numpy as np
import torch.distributed as dist
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import get_blend_from_list
from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

from dtgpt.data.indexed import IndexedDatasetWriter

VOCAB = 1000


def write_documents(prefix: str, documents: int, seed: int, low: int = 0, high: int = VOCAB,
                    eod: Optional[int] = None) -> str:
    """`documents` documents of 1-59 tokens in [low, high), every 17th one empty (Megatron skips
    those); with `eod`, every non-empty one ends with it."""
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for i in range(documents):
            n = 0 if i % 17 == 3 else int(rng.integers(1, 60))
            tokens = rng.integers(low, high, n)
            w.add_document(np.append(tokens, eod) if eod is not None and n else tokens)
    return prefix


@contextlib.contextmanager
def one_rank_group(directory: str):
    """A 1-rank gloo process group for the duration of a Megatron build, removed afterwards."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(directory, 'pg-store')}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def megatron_null_tokenizer(ids: int = VOCAB) -> NullTokenizer:
    """megatron-core's NullTokenizer with the ids 0..ids-1 and the eod `ids` after them (ids + 1
    rows, as dtgpt's NullTokenizer(ids)). megatron-core 0.19 changed what its argument means:
    0.16's NullTokenizer(n) has n + 1 rows and eod n, 0.19's n rows and eod n - 1."""
    tokenizer = NullTokenizer(ids + 1)
    return tokenizer if tokenizer.eod == ids else NullTokenizer(ids)


PER_TOKEN_OFF = dict(reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                     create_attention_mask=False)


def megatron_datasets(cache_dir: str, sizes: tuple[int, int, int], seq_length: int, seed: int,
                      data_path: Optional[list[str]] = None, split: Optional[str] = None,
                      per_split_paths: Optional[list[list[str]]] = None, **per_token) -> list:
    """Megatron's (train, valid, test) for a data_path + split, or for per-split blends;
    `per_token` sets GPTDatasetConfig's eod_mask_loss, reset_* and create_attention_mask (all off)."""
    blend, blend_per_split = None, None
    if data_path:
        blend = get_blend_from_list(data_path)
    else:
        blend_per_split = [get_blend_from_list(p) if p else None for p in per_split_paths]
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=blend, blend_per_split=blend_per_split,
        split=split, path_to_cache=os.path.join(cache_dir, "megatron"), tokenizer=megatron_null_tokenizer(),
        **{**PER_TOKEN_OFF, **per_token},
    )
    with one_rank_group(cache_dir):
        return BlendedMegatronDatasetBuilder(GPTDataset, list(sizes), lambda: True, config).build()


def megatron_mock_datasets(cache_dir: str, sizes: tuple[int, int, int], seq_length: int, seed: int, split: str) -> list:
    """Megatron's (train, valid, test) MockGPTDataset, as its simple training loop builds them
    (no blend: the config turns `mock` on itself)."""
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, split=split,
        path_to_cache=os.path.join(cache_dir, "megatron-mock"), tokenizer=megatron_null_tokenizer(), **PER_TOKEN_OFF,
    )
    with one_rank_group(cache_dir):
        return BlendedMegatronDatasetBuilder(MockGPTDataset, list(sizes), lambda: True, config).build()


def megatron_sample(dataset, i: int) -> np.ndarray:
    """Megatron's sample i as dtgpt returns samples: the seq_length + 1 tokens (tokens + the last label)."""
    item = dataset[i]
    return np.concatenate([item["tokens"].numpy(), item["labels"].numpy()[-1:]])


def run_megatron_gpt(command: str, root, nproc: int = 1, *flags: str) -> None:
    """tests/megatron_gpt.py under torchrun (one gloo rank per TP rank): megatron-core's GPTModel
    saves, writes the per-rank format, or loads `root`; its logits land in root/*.pt."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("megatron_gpt.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(script), command, str(root), *flags]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
