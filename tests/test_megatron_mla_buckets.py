"""Megatron-LM's default distributed-optimizer layout (dp_reshardable) of the multi-latent attention +
MoE + MTP model's Adam state, read bit for bit as megatron-core's model-space save of the same
state (tests/megatron_mla_adam.py, in conftest's mla_root launch), under the local layer spec and
as Transformer Engine's spec holds multi-latent attention at tp 2 (tests/megatron_mla_te.py),
which resumes bit for bit as the local spec's save of the same state.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dtgpt.api import build_model, build_train_state, init_distributed, train_step
from dtgpt.checkpoint.megatron import find
from dtgpt.checkpoint.megatron.keys import full_model_shapes, is_buffer
from dtgpt.checkpoint.megatron.load import load_into_state
from dtgpt.checkpoint.megatron.reader import MegatronReader
from dtgpt.config import Config, load_config
from dtgpt.state import TrainState
from tests.megatron_gpt import VOCAB
from tests.megatron_mla_oracle import ADAM_RUN, MODEL, ROWS, model_cfg


TP_RANKS = ("optimizer.distributed.dp_group_idx_0", "optimizer.distributed.dp_group_idx_1")
BUCKETED = {"ep2": ("megatron_adam_dp_reshardable", "megatron_adam", "local", 4 + 3 + 3, tuple(f"chained_1.{rank}" for rank in TP_RANKS)),
            "tp2": ("megatron_adam_tp2/dp_reshardable", "megatron_adam_tp2", "local", 2, TP_RANKS),
            "tp2_te": ("megatron_adam_tp2_te/dp_reshardable", "megatron_adam_tp2_te", "transformer_engine", 2, TP_RANKS),
            "pp2": ("megatron_adam_pp2/dp_reshardable", "megatron_adam_pp2", "local", 4, TP_RANKS[1:])}  # fmt: skip
"""(dp_reshardable save, model-space save of the same state, the layer order it is read in,
buckets of its grad buffers, those that hold the MTP block's experts) by layout
(tests/megatron_mla_adam.py): dp 2 x ep 2 (the dense buffer and each expert-parallel rank's, cut
into buckets; chained_1 is the experts' optimizer); tp 2 (dp 1, ep 1: the experts in each tp
rank's one bucket, split over expert tp 2), under the local spec and as Transformer Engine's spec
holds multi-latent attention (tests/megatron_mla_te.py); pp 2 (the embedding in a bucket of its
own on the first stage, and on the last its copy for the MTP block, never read)."""


@pytest.mark.slow
@pytest.mark.parametrize("layout_name", list(BUCKETED))
def test_megatron_mla_moe_mtp_dp_reshardable_adam_state_reads_as_its_model_space_save(mla_root, layout_name):
    """Megatron-LM's default layout (dp_reshardable, without --dist-ckpt-optim-fully-reshardable)
    of the MLA + MoE + MTP model's Adam state: every tensor and every slot (master weights, both
    moments) reads bit for bit as megatron-core's model-space save of the same state (the MTP
    block between the decoder's final norm and the head; at ep 2 the experts of the decoder's MoE
    layers and of the MTP block from each expert-parallel rank's own buffers, chained_1; at tp 2
    each rank's shards of MLA's projections, rows, and eh_proj's, or under Transformer Engine's
    spec the down-projections whole on each rank and the compressed vectors' norms fused into the
    up-projections; at pp 2 the MTP block's embedding copy on the last stage left unread)."""
    saved, model_space, order, bucket_count, mtp_buffers = BUCKETED[layout_name]
    shapes = full_model_shapes(model_cfg(), ROWS)
    buckets, gathered = (MegatronReader(find(mla_root / name)) for name in (saved, model_space))
    for reader in (buckets, gathered):
        reader.check(shapes, list(shapes))
    found, spec = buckets.bucket_layout()
    assert (spec, found.experts) == (order, "SequentialMLP")
    assert sum(key.endswith(".param") and ".distributed." in key for key in buckets.shapes) == bucket_count
    mtp_experts = found.pieces[("mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc1.weight", None)]
    assert {piece.prefix.split(".gbuf")[0] for piece in mtp_experts} == set(mtp_buffers)
    for slot in (None, "param", "exp_avg", "exp_avg_sq"):  # one read of every tensor a slot
        wanted = {name: (name, slot, (0,) * len(shape), shape) for name, shape in shapes.items() if slot is None or not is_buffer(name)}
        ours, theirs = buckets.regions(wanted), gathered.regions(wanted)
        for name in wanted:
            assert torch.equal(ours[name], theirs[name]), (name, slot)


RESUMED_BATCH = 2


def resumed(directory: Path) -> tuple[Config, TrainState, list[str]]:
    """One process's train state (ADAM_RUN's config, without the LR warmup: the synthetic step's
    schedule stands at 0 samples; 2 samples a step, to keep it short) loaded from a Megatron
    checkpoint, as train.py's checkpoint.load reads it; the notes it logs."""
    cfg = load_config(None, [*ADAM_RUN, "--optimizer.lr_warmup_iters=0", f"--training.global_batch_size={RESUMED_BATCH}"])
    state = build_train_state(cfg, build_model(cfg, init_distributed(cfg), VOCAB))
    return cfg, state, load_into_state(state, find(directory), cfg, stateful=True)


def every_tensor(state: TrainState) -> dict[str, torch.Tensor]:
    """The parameters, buffers (the expert biases) and AdamW state of a one-process train state."""
    part, optimizer = state.model.parts[0], state.optimizer.optimizers[0]
    names = {id(param): name for name, param in part.named_parameters()}
    tensors = {f"model.{name}": value.detach().clone() for name, value in part.state_dict().items()}
    return tensors | {f"{names[id(p)]}.{slot}": v.clone() for p, slots in optimizer.state.items() for slot, v in slots.items()}


@pytest.mark.slow
def test_transformer_engines_mla_buckets_at_tp2_resume_bit_for_bit_as_the_local_specs(mla_root):
    """The same weights and Adam step at tp 2 saved dp_reshardable under the local spec and as
    Transformer Engine's spec holds multi-latent attention (tests/megatron_mla_adam.py): a process
    resumed from each loads the same fp32 master weights, moments and step bit for bit, each in
    its own layer order, and its next step on one batch leaves the same weights and moments."""
    runs = {spec: resumed(mla_root / BUCKETED[name][0]) for spec, name in (("local", "tp2"), ("transformer_engine", "tp2_te"))}
    batch = torch.randint(0, VOCAB, (RESUMED_BATCH, MODEL["seq_length"] + 1), generator=torch.Generator().manual_seed(0))
    tensors = {}
    for spec, (cfg, state, notes) in runs.items():
        assert "optimizer state loaded: fp32 master weights (param), Adam moments, step 1" in notes
        assert f"optimizer state read from the distributed optimizer's dp_reshardable buckets ({spec} layer order, SequentialMLP experts)" in notes
        loaded = every_tensor(state)
        train_step(cfg, state, batch)
        tensors[spec] = (loaded, every_tensor(state))
    (local_loaded, local_stepped), (te_loaded, te_stepped) = tensors.values()
    assert local_loaded.keys() == te_loaded.keys() and any(key.endswith(".exp_avg_sq") for key in te_loaded)
    for key in local_loaded:
        assert torch.equal(local_loaded[key], te_loaded[key]), key
        assert torch.equal(local_stepped[key], te_stepped[key]), key
    for key in ("model.embedding.word.weight", "embedding.word.weight.exp_avg"):  # the step moved the weights and moments
        assert not torch.equal(te_loaded[key], te_stepped[key]), key
