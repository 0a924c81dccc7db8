"""megatron-core's two pipeline stages of a tied GPT (tests/megatron_gpt.py's "gpt" model at tp 1,
pp 2): the first holds the word embeddings and layer 0, the last layer 1, the final norm and the
head as `output_layer.weight`, its copy of the word embeddings. Called by tests/megatron_gpt.py's
`load` when ROOT/per_rank_pp2 holds dtgpt's `to-megatron --format per-rank --pp 2` files: each
stage loads its own file strictly (every key, shape and _extra_state) and the last writes its
logits of tokens() to ROOT/loaded_pp2_logits.pt.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from tests.megatron_gpt import ARCHS, HEADS, HIDDEN, LAYERS, SEQ, inputs


def load_tied_stages(root: Path) -> None:
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 2)
    rank = dist.get_rank()
    # the tied stages' all-reduce of the embedding copy moves it to CUDA first
    torch.Tensor.cuda = lambda tensor, *args, **kwargs: tensor
    iteration = int((root / "per_rank_pp2" / "latest_checkpointed_iteration.txt").read_text())
    own = torch.load(root / "per_rank_pp2" / f"iter_{iteration:07d}" / f"mp_rank_00_{rank:03d}" / "model_optim_rng.pt",
                     weights_only=False)["model"]  # fmt: skip
    rows = (own.get("embedding.word_embeddings.weight") if rank == 0 else own["output_layer.weight"]).shape[0]
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=0.02, bias_dropout_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, **ARCHS["gpt"]["config"],
    )  # fmt: skip
    torch.manual_seed(99)
    stage = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=rows, max_sequence_length=SEQ,
                     share_embeddings_and_output_weights=True, pre_process=rank == 0, post_process=rank == 1,
                     **ARCHS["gpt"]["model"])  # fmt: skip
    stage.load_state_dict(own, strict=True)
    stage.eval()
    ids, positions, mask = inputs()
    with torch.no_grad():
        if rank == 0:
            dist.send(stage(ids, positions, mask).contiguous(), dst=1)
        else:
            hidden = torch.empty(ids.shape[1], ids.shape[0], HIDDEN)  # (T, B, H), Megatron's
            dist.recv(hidden, src=0)
            stage.set_input_tensor(hidden)
            torch.save(stage(None, positions, mask), root / "loaded_pp2_logits.pt")
    dist.barrier()
    parallel_state.destroy_model_parallel()
