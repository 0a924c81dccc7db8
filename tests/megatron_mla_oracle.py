"""The DeepSeek-style model (multi-latent attention + MoE + multi-token prediction) that
megatron-core's own GPTModel checks dtgpt's Megatron checkpoints of, and the one launch that does it.

launch_mla_oracle: dtgpt saves the model (untied, and tied) and converts it to Megatron's formats
(torch_dist; per-rank at tp 2, and at pp 2), then megatron-core's launch on 2 gloo ranks
(tests/megatron_mla_gpt.py) saves its own checkpoints of it, loads dtgpt's, and records its
logits and losses; tests/conftest.py's mla_root runs it once for the test modules that read it
(test_megatron_mla_checkpoint.py, _resume.py, _buckets.py, _muon.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

import dtgpt
from dtgpt.config import ModelConfig
from dtgpt.data.batch import IGNORE_INDEX
from dtgpt.mtp import depth_labels
from tests.megatron_adam import ADAM
from tests.megatron_gpt import CONSUMED, ITERATION, VOCAB, labels, tokens
from tests.megatron_mla_adam import SCHEDULE
from tests.megatron_mla_gpt import DENSE, EXPERTS, HEADS, HIDDEN, LATENT, LAYERS, MOE, MOE_LAYERS, MTP
from tests.test_checkpoint_convert import load_script
from tests.test_megatron_moe_checkpoint import launch, save_dtgpt


PP2 = ["--format", "per-rank", "--pp", "2", "--decoder-first-pipeline-num-layers", "1"]
"""Megatron-LM's split of the 3 layers that megatron_mla_gpt.py's pp 2 stages build: the dense one first."""
ROWS = 128  # 100 padded to a multiple of 16 x tp 2, Megatron's
SCRIPT = Path(__file__).with_name("megatron_mla_gpt.py")
MODEL = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, seq_length=32, hidden_dropout=0.0,
             attention_dropout=0.0, make_vocab_size_divisible_by=32, position_embedding_type="rope", swiglu=True,
             untie_embeddings_and_output_weights=True, multi_latent_attention=True, num_experts=EXPERTS,
             moe_layer_freq=str(MOE_LAYERS), **MTP, **DENSE, **LATENT, **MOE)  # fmt: skip


TIED = {**MODEL, "untie_embeddings_and_output_weights": False}


def model_cfg(**overrides) -> ModelConfig:
    return ModelConfig(**{**MODEL, **overrides})


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    ours, theirs = ours[..., :VOCAB], theirs[..., :VOCAB]
    return ((ours - theirs).norm() / theirs.norm()).item()


@torch.no_grad()
def head_outputs(model) -> torch.Tensor:
    """(1 + MTP depths, B, T, vocabulary rows): dtgpt's logits of tokens(), the main model's then
    each depth's (a model in training mode gives the depths' too; dropout is 0)."""
    model.train()
    out = torch.stack(model(tokens()))
    model.eval()
    return out


def assert_same_outputs(ours: torch.Tensor, root: Path, prefix: str = "") -> None:
    theirs = torch.load(root / f"{prefix}logits.pt", weights_only=True)
    assert ours.shape == theirs.shape  # the main model's logits and the MTP depth's
    for depth in range(len(ours)):
        assert relative_error(ours[depth], theirs[depth]) < 1e-5, depth
    torch.testing.assert_close(loss_of(ours[0]), torch.load(root / f"{prefix}loss.pt", weights_only=True), rtol=1e-5, atol=0)
    # each depth's loss on its shifted labels (the last positions ignored), as Megatron tracks it
    mtp = torch.stack([torch.nn.functional.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=IGNORE_INDEX)
                       for logits, shifted in zip(ours[1:], depth_labels(labels(), len(ours) - 1))])  # fmt: skip
    torch.testing.assert_close(mtp, torch.load(root / f"{prefix}mtp_loss.pt", weights_only=True), rtol=1e-5, atol=0)


def loss_of(logits: torch.Tensor) -> torch.Tensor:
    """megatron-core's loss as tests/megatron_gpt.py takes it: the token mean over every padded row."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels().flatten())


STEPS = 2
"""iterations a run resumed from megatron-core's checkpoint (iteration 7) trains"""
TRAIN_ON = [*(f"--model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in MODEL.items()),
            "--data.mock_data=true", "--data.tokenizer_type=NullTokenizer", f"--data.vocab_size={VOCAB}", "--data.num_workers=0",
            "--training.micro_batch_size=2", "--training.global_batch_size=8", f"--training.train_iters={ITERATION + STEPS}",
            "--optimizer.lr=3e-3", "--optimizer.lr_warmup_iters=2", "--eval.eval_iters=0", "--logging.log_interval=1"]  # fmt: skip
"""train.py on from megatron-core's checkpoint: its model, 8 samples a global batch as its 56 consumed ones"""
ADAM_RUN = [*(arg for arg in TRAIN_ON if not arg.startswith(("--optimizer.", "--training.train_iters="))),
            *(f"--optimizer.{key}={value}" for key, value in {**ADAM, **SCHEDULE}.items()),
            f"--training.train_iters={ITERATION + 1}", "--training.calculate_per_token_loss=false"]  # fmt: skip
"""train.py one iteration on from megatron-core's checkpoint with Adam state (tests/megatron_mla_adam.py),
with its optimizer, LR schedule and loss: Megatron-LM's default, the mean of micro-batch means, whose
MTP term divides each depth's token losses by that depth's own token count (T - 1 a sequence at
depth 1); dtgpt's default per-token loss divides them by the LM loss's (T), 3% less gradient here."""


def first_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, labels) of the global batch a run of TRAIN_ON resumed at megatron-core's consumed
    samples trains on first (dtgpt's data order, read here as train.py reads it)."""
    from dtgpt.config import load_config

    cfg = load_config(None, TRAIN_ON + ["--training.micro_batch_size=8"])
    batch = next(dtgpt.build_train_iterator(cfg, dtgpt.build_model(cfg, dtgpt.init_distributed(cfg), VOCAB), CONSUMED))
    return batch.tokens, batch.labels



def launch_mla_oracle(root: Path) -> None:
    """dtgpt's checkpoints and their to-megatron conversions under root, then megatron-core's launch at tp 2."""
    save_dtgpt(root / "dtgpt", MODEL)
    assert load_script().main(["to-megatron", str(root / "dtgpt"), str(root / "from_dtgpt")]) == 0
    per_rank = ["--format", "per-rank", "--tp", "2"]
    assert load_script().main(["to-megatron", str(root / "dtgpt"), str(root / "from_dtgpt_per_rank"), *per_rank]) == 0
    assert load_script().main(["to-megatron", str(root / "dtgpt"), str(root / "from_dtgpt_pp2"), *PP2]) == 0
    save_dtgpt(root / "dtgpt_tied", TIED)  # megatron-core's tied stages load its pp 2 files
    assert load_script().main(["to-megatron", str(root / "dtgpt_tied"), str(root / "from_dtgpt_tied_pp2"), *PP2]) == 0
    torch.save(first_batch(), root / "batch.pt")  # megatron-core's losses on it: batch_losses.pt
    launch(SCRIPT, root)
