"""What the Megatron checkpoint tests share: the 2-layer GPT megatron-core saves (its config and
padded rows), its logits and loss as dtgpt computes them after a load, Megatron-LM's per-rank files
cut into pipeline stages, and train.py's arguments for runs that load those checkpoints."""

from __future__ import annotations

import torch

from dtgpt.api import build_model, build_train_state, forward_backward, init_distributed, load_checkpoint, make_config
from dtgpt.checkpoint.megatron import load_megatron_model
from dtgpt.checkpoint.megatron.formats import PER_RANK_FILE
from dtgpt.config import ModelConfig
from dtgpt.data.batch import Batch
from tests.megatron_adam import ADAM
from tests.megatron_gpt import HEADS, ITERATION, SEQ, VOCAB, labels, tokens
from tests.runs import TINY

ROWS = 112  # the padded vocabulary: 100 -> a multiple of 16 (Megatron at tp 1, dtgpt)
ROWS_TP2 = 128  # Megatron at tp 2: a multiple of 32


def model_cfg(**overrides) -> ModelConfig:
    fields = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, hidden_dropout=0.0,
                  attention_dropout=0.0, make_vocab_size_divisible_by=16)  # fmt: skip
    return ModelConfig(**{**fields, **overrides})


def assert_same_logits(root, directory, cfg: ModelConfig, name: str = "logits.pt", rows: int = ROWS) -> None:
    model = load_megatron_model(directory, cfg, rows).eval()
    with torch.no_grad():
        ours = model(tokens())[..., :VOCAB]
    theirs = torch.load(root / name, weights_only=True)[..., :VOCAB]
    assert ((ours - theirs).norm() / theirs.norm()).item() < 1e-5


def imported_loss(root, divisible_by: int) -> float:
    """dtgpt's loss of tokens() -> labels() (the library's forward) after loading the Megatron
    checkpoint under root into a model padded to a multiple of `divisible_by`."""
    cfg = make_config(
        model=dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=SEQ, hidden_dropout=0.0,
                   attention_dropout=0.0, make_vocab_size_divisible_by=divisible_by),
        data=dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=VOCAB),
        training=dict(micro_batch_size=2, global_batch_size=2),
    )  # fmt: skip
    runtime = init_distributed(cfg)
    state = build_train_state(cfg, build_model(cfg, runtime, VOCAB))
    load_checkpoint(root, cfg, runtime, state)
    return forward_backward(state.model, Batch(tokens(), labels()), 1, forward_only=True)


def write_stages(saved: dict, out, tp: int, pp: int, chunks: list[str], layers: int, counts: list[int] | None = None) -> None:
    """One tp rank's whole per-rank model (`saved`, layers numbered 0..layers-1) as Megatron-LM
    saves it cut into pp ranks, each holding `chunks` (["model"], or with virtual pipelining
    ["model0", "model1", ...]; chunk v of pp rank r is stage v * pp + r), layers numbered within
    their chunk (`counts` per stage, else even), the embedding on the first stage, the final norm,
    head and multi-token prediction modules on the last."""
    stages = pp * len(chunks)
    counts = counts or [layers // stages] * stages
    first = [sum(counts[:stage]) for stage in range(stages)]
    files = [{**{k: v for k, v in saved.items() if k != "model"}, **{c: {} for c in chunks}} for _ in range(pp)]
    for key, value in saved["model"].items():
        if key.startswith("decoder.layers."):
            layer, rest = key[len("decoder.layers."):].split(".", 1)
            stage = max(s for s in range(stages) if first[s] <= int(layer))
            key = f"decoder.layers.{int(layer) - first[stage]}.{rest}"
        else:
            stage = stages - 1 if key.startswith(("decoder.final", "output_layer", "mtp.")) else 0
        files[stage % pp][chunks[stage // pp]][key] = value
    for r, content in enumerate(files):
        (out / f"mp_rank_{tp:02d}_{r:03d}").mkdir(parents=True, exist_ok=True)
        torch.save(content, out / f"mp_rank_{tp:02d}_{r:03d}" / PER_RANK_FILE)


MEGATRON_RUN = [
    *TINY, "--model.num_layers=2", "--model.make_vocab_size_divisible_by=16", "--data.vocab_size=100",
    "--model.untie_embeddings_and_output_weights=true", f"--training.train_iters={ITERATION + 5}",
    "--logging.log_interval=1",
]  # fmt: skip


ADAM_RUN = [
    *MEGATRON_RUN, "--model.untie_embeddings_and_output_weights=false", "--optimizer.lr_decay_style=constant",
    "--optimizer.lr_warmup_iters=0", *(f"--optimizer.{key}={value}" for key, value in ADAM.items()),
]  # fmt: skip


def without_key_bias(key: str, value: torch.Tensor) -> torch.Tensor:
    """The QKV bias without its key rows: their gradient is zero (softmax ignores a shift of the
    scores), so Adam divides rounding noise by its own size there and both sides step by noise."""
    if key != "decoder.layers.self_attention.linear_qkv.bias":
        return value
    return value.view(value.shape[0], HEADS, 3, -1)[:, :, [0, 2]]  # per head: [q | k | v]
