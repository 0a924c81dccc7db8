"""megatron-core's own MoE GPTModel on CPU: the oracle for Megatron MoE checkpoints in and out.

Run under torchrun with one gloo rank per expert-parallel rank (tp 1, pp 1; ep = the world):

    python tests/megatron_moe_gpt.py ROOT

builds a 2-layer Llama-style model whose MLPs are MoE layers (4 routed experts of SequentialMLP,
top-2 of a sigmoid router with the expert bias, a SwiGLU shared expert with its gate), its router weights and
expert biases drawn wide so that routing depends on them, then in one launch:
- saves Megatron-LM's torch_dist iteration under ROOT/megatron and the per-rank format
  (mp_rank_00[_EEE]/model_optim_rng.pt, each expert-parallel rank's `local_experts.K`) under
  ROOT/megatron_per_rank, and writes its logits to ROOT/logits.pt;
- if ROOT/from_dtgpt holds a checkpoint (dtgpt's to-megatron), builds the model again from
  another seed, loads it with dist_checkpointing and writes ROOT/loaded_logits.pt;
- if ROOT/from_dtgpt_per_rank holds per-rank files (to-megatron --format per-rank --ep N), each
  rank loads its own with a strict load_state_dict, and ROOT/loaded_per_rank_logits.pt follows;
- saves the distributed optimizer's Adam state after one step, at ep 2 and at ep 1, under
  ROOT/adam_ep2 and ROOT/adam_ep1 (tests/megatron_moe_adam.py).

megatron-core runs with tests/megatron_gpt.py's CPU patches and one more (the MoE layer's
Transformer Engine GEMM, absent: moe_utils.te_general_gemm = None), and the allgather dispatcher
(the all-to-all one asks for a CUDA stream).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.megatron_gpt, run as a script

from tests.megatron_gpt import ARCHS, ITERATION, SEQ, inputs, padded_vocab, patch_megatron, trainer_state  # noqa: E402

EXPERTS, TOPK, EXPERT_FFN, SHARED_FFN = 4, 2, 32, 48
MOE_CONFIG = dict(num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=EXPERT_FFN,
                  moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                  moe_shared_expert_intermediate_size=SHARED_FFN, moe_shared_expert_gate=True, moe_token_dispatcher_type="allgather",
                  moe_aux_loss_coeff=0.0)  # fmt: skip
MOE_ARGS = dict(num_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=EXPERT_FFN, moe_layer_freq=1,
                moe_router_score_function="sigmoid", moe_router_pre_softmax=False, moe_router_enable_expert_bias=True,
                moe_shared_expert_intermediate_size=SHARED_FFN, moe_shared_expert_gate=True, pipeline_model_parallel_size=1)  # fmt: skip
"""Megatron-LM's args for the MoE part, as its common.pt keeps them."""


def build(ep: int, seed: int, tp: int = 1, etp: int | None = None, pp: int = 1, vp: int | None = None, layers: int = 2):
    """The seeded model at expert parallelism `ep`, tp `tp`, expert tp `etp` (None: tp, Megatron's
    default) and pp `pp` (this rank's stage; with `vp` virtual stages, the list of its model chunks,
    each seeded apart as tests/megatron_gpt.py's); the groups are set up here unless they already are."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vp, expert_model_parallel_size=ep,
                                                 expert_tensor_parallel_size=etp)  # fmt: skip
    chunks = [chunk_model(ep, seed, tp, etp, pp, vp, layers, stage) for stage in range(vp or 1)]
    return chunks if vp else chunks[0]


def chunk_model(ep: int, seed: int, tp: int, etp: int | None, pp: int, vp: int | None, layers: int, vp_stage: int):
    """build's model chunk `vp_stage` of this rank (the whole stage without virtual stages)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=layers, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True, hidden_dropout=0.0,
        attention_dropout=0.0, init_method_std=0.02, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        tensor_model_parallel_size=tp, expert_tensor_parallel_size=etp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp, pipeline_dtype=torch.float32,
        expert_model_parallel_size=ep, **ARCHS["llama"]["config"], **MOE_CONFIG,
    )  # fmt: skip
    stage = vp_stage if vp else None
    torch.manual_seed(seed + vp_stage)
    model = GPTModel(config, get_gpt_layer_local_spec(num_experts=EXPERTS), vocab_size=padded_vocab(tp),
                     max_sequence_length=SEQ, share_embeddings_and_output_weights=False, position_embedding_type="rope",
                     pre_process=parallel_state.is_pipeline_first_stage(False, stage),
                     post_process=parallel_state.is_pipeline_last_stage(False, stage), vp_stage=stage)  # fmt: skip
    draw_wide(model, seed + vp_stage)
    return model


@torch.no_grad()
def draw_wide(model, seed: int) -> None:
    """Every rank the same draws: router weights and expert biases from a unit normal (a wide
    spread of logits, biases far from zero), norms in [0.5, 1.5] (a mix-up of any would show)."""
    draw = torch.Generator().manual_seed(seed)
    routers = [m for m in model.modules() if getattr(m, "expert_bias", None) is not None]  # MTP's too
    for router in routers:
        router.weight.copy_(torch.randn(router.weight.shape, generator=draw))
        router.expert_bias.copy_(torch.randn(router.expert_bias.shape, generator=draw))
    for name, p in model.named_parameters():
        if "layernorm" in name or name.endswith(("enorm.weight", "hnorm.weight")):
            p.uniform_(0.5, 1.5, generator=draw)


@torch.no_grad()
def logits(model) -> torch.Tensor:
    model.eval()
    return model(*inputs())


def common(ep: int, tp: int = 1, etp: int | None = None) -> dict:
    state = trainer_state(tp, arch="llama", untied=True)
    vars(state["args"]).update(MOE_ARGS, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp or tp)
    return state


def main(root: Path) -> None:
    from megatron.core import dist_checkpointing, parallel_state

    patch_megatron()
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None
    dist.init_process_group("gloo")
    ep, rank = dist.get_world_size(), dist.get_rank()
    model = build(ep, 1234)
    state = common(ep)
    directory = root / "megatron" / f"iter_{ITERATION:07d}"
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict(), **state}, str(directory))
    # Megatron-LM's legacy save: one file per (tp, pp, ep) rank, its experts numbered locally
    suffix = f"_{parallel_state.get_expert_model_parallel_rank():03d}" if ep > 1 else ""
    rank_dir = root / "megatron_per_rank" / f"iter_{ITERATION:07d}" / f"mp_rank_00{suffix}"
    rank_dir.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.state_dict_for_save_checkpoint(), **state}, rank_dir / "model_optim_rng.pt")
    out = logits(model)
    if rank == 0:
        for name in ("megatron", "megatron_per_rank"):
            (root / name / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
        torch.save(out, root / "logits.pt")
    dist.barrier()
    dtgpt_out = root / "from_dtgpt"
    if dtgpt_out.is_dir():
        other = build(ep, 99)
        iteration = int((dtgpt_out / "latest_checkpointed_iteration.txt").read_text())
        loaded = dist_checkpointing.load(other.sharded_state_dict(), str(dtgpt_out / f"iter_{iteration:07d}"))
        other.load_state_dict(loaded, strict=False)
        out = logits(other)
        if rank == 0:
            torch.save(out, root / "loaded_logits.pt")
    per_rank = root / "from_dtgpt_per_rank"
    if per_rank.is_dir():  # Megatron-LM's legacy load: each rank its own file, strictly
        other = build(ep, 99)
        iteration = int((per_rank / "latest_checkpointed_iteration.txt").read_text())
        own = per_rank / f"iter_{iteration:07d}" / f"mp_rank_00{suffix}" / "model_optim_rng.pt"
        other.load_state_dict(torch.load(own, weights_only=False)["model"], strict=True)
        out = logits(other)
        if rank == 0:
            torch.save(out, root / "loaded_per_rank_logits.pt")
    dist.barrier()
    # the distributed optimizer's Adam state, at this ep and at ep 1 (tests/megatron_moe_adam.py)
    from tests.megatron_adam import patch_for_optimizer
    from tests.megatron_moe_adam import save_moe_adam

    patch_for_optimizer()
    for adam_ep in (ep, 1):
        if adam_ep != ep:
            parallel_state.destroy_model_parallel()
            parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=adam_ep)
        save_moe_adam(root / f"adam_ep{adam_ep}", adam_ep, lambda: build(adam_ep, 1234), common(adam_ep))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    main(Path(sys.argv[1]))
