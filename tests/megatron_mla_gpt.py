"""megatron-core's own DeepSeek-style GPTModel on CPU: the oracle for Megatron checkpoints of a
multi-latent attention + MoE + multi-token prediction model, in and out.

Run under torchrun with one gloo rank per tensor-parallel rank (pp 1, ep 1):

    python tests/megatron_mla_gpt.py ROOT

builds a 3-layer model with multi-latent attention (a compressed query, norms on the compressed
query and key/value, YaRN), one dense layer then two MoE layers (moe_layer_freq [0, 1, 1]: 8
routed SequentialMLP experts, top-4 of sigmoid scores with the expert bias, limited to 2 of 4
groups, the weights scaled by 2.5, a shared expert) and one multi-token prediction layer (an MoE
block, as the last layer), its router weights, expert biases and norms drawn wide, then in one launch:
- saves Megatron-LM's torch_dist iteration under ROOT/megatron, the norms of the compressed
  vectors under the local layer spec's names (self_attention.q_layernorm, kv_layernorm), and
  under ROOT/megatron_te with the names Megatron's Transformer Engine spec gives them (fused into
  the up-projections: self_attention.linear_q_up_proj.layer_norm_weight, ...; the dense layer's
  pre-MLP norm into mlp.linear_fc1), which the local model writes through its layers'
  sharded_state_dict_keys_map; writes ROOT/logits.pt (the head's logits of the main model, then of
  the MTP depth), its own LM loss on tests/megatron_gpt.py's labels, ROOT/loss.pt, and the MTP
  depth's loss as its forward tracks it in training mode, ROOT/mtp_loss.pt; given ROOT/batch.pt
  (tokens, labels), its LM and MTP losses on that batch, ROOT/batch_losses.pt;
- saves Megatron-LM's legacy per-rank format under ROOT/megatron_per_rank (mp_rank_TT/model_optim_rng.pt:
  each tp rank's own state dict, the local spec's names);
- if ROOT/from_dtgpt holds a checkpoint (dtgpt's to-megatron), builds the model again from
  another seed (with the Transformer Engine names), loads it with dist_checkpointing and writes
  ROOT/loaded_logits.pt, ROOT/loaded_loss.pt and ROOT/loaded_mtp_loss.pt;
- if ROOT/from_dtgpt_per_rank holds per-rank files (to-megatron --format per-rank --tp 2), each
  rank loads its own with a strict load_state_dict and writes ROOT/loaded_per_rank_*.pt likewise;
- at pp 2, its stages' per-rank files (pipeline_stages below), and given ROOT/from_dtgpt_tied_pp2
  (dtgpt's model with a tied head, to-megatron --pp 2) its tied stages' logits (tied_stages);
- which parameters megatron-core's Muon builder gives Muon, ROOT/muon_params.json (tests/megatron_muon.py);
- with its distributed optimizer at ep 2, a checkpoint carrying Adam state and the next step's
  (ROOT/megatron_adam, ROOT/megatron_adam_stepped: tests/megatron_mla_adam.py).

megatron-core runs with tests/megatron_moe_gpt.py's CPU patches and the two of tests/test_mla.py
(its local core attention without the k_channels/v_channels keywords, HAVE_TE False in its MLA module).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.megatron_gpt, run as a script

from tests.megatron_gpt import ITERATION, SEQ, inputs, labels, loss, padded_vocab, patch_megatron, tokens, trainer_state  # noqa: E402
from tests.megatron_moe_gpt import draw_wide  # noqa: E402

LAYERS, HIDDEN, HEADS = 3, 64, 4
MOE_LAYERS = [0, 1, 1]
"""DeepSeek-V3's dense-first layers (its moe_layer_freq list): megatron-core then stores every layer apart."""
MTP = dict(mtp_num_layers=1, mtp_loss_scaling_factor=0.3)
EXPERTS, TOPK, EXPERT_FFN, SHARED_FFN, GROUPS, GROUP_TOPK, SCALING = 8, 4, 32, 48, 4, 2, 2.5
LATENT = dict(q_lora_rank=24, kv_lora_rank=16, qk_head_dim=12, qk_pos_emb_head_dim=8, v_head_dim=10, rope_type="yarn",
              rotary_scaling_factor=40.0, mscale=0.707, mscale_all_dim=1.0)  # fmt: skip
"""The latent attention's shape and YaRN, by the names MLATransformerConfig and Megatron-LM's args share."""
MOE = dict(moe_router_topk=TOPK, moe_ffn_hidden_size=EXPERT_FFN, moe_router_score_function="sigmoid",
           moe_router_enable_expert_bias=True, moe_shared_expert_intermediate_size=SHARED_FFN,
           moe_router_num_groups=GROUPS, moe_router_group_topk=GROUP_TOPK, moe_router_topk_scaling_factor=SCALING)  # fmt: skip
DENSE = dict(ffn_hidden_size=128, normalization="RMSNorm", add_bias_linear=False, qk_layernorm=True)
TE_NORM_NAMES = {"self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
                 "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_"}  # fmt: skip
"""The local spec's norm modules -> the names Transformer Engine's fused norm+linear gives them."""
DENSE_TE_NORM_NAMES = {**TE_NORM_NAMES, "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
"""A dense layer's too: its pre-MLP norm is fused into linear_fc1 (an MoE layer's stays a module)."""


def te_norm_names(moe: bool) -> dict[str, str]:
    return dict(TE_NORM_NAMES if moe else DENSE_TE_NORM_NAMES)


def args_update(tp: int) -> dict:
    """Megatron-LM's args for this model beyond tests/megatron_gpt.py's Llama ones."""
    return dict(**DENSE, **LATENT, **MOE, multi_latent_attention=True, group_query_attention=False,
                num_query_groups=HEADS, kv_channels=HIDDEN // HEADS, num_experts=EXPERTS, moe_layer_freq=MOE_LAYERS, **MTP,
                moe_router_pre_softmax=False, swiglu=True, pipeline_model_parallel_size=1,
                tensor_model_parallel_size=tp, padded_vocab_size=padded_vocab(tp))  # fmt: skip


def _core_without_channels():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class CoreWithoutChannels(DotProductAttention):
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)

    return CoreWithoutChannels


def _layer_spec(num_experts: int | None, te_names: bool):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=num_experts, multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = _core_without_channels()
    if te_names:
        spec.submodules.sharded_state_dict_keys_map = te_norm_names(num_experts is not None)
    return spec


def build(tp: int, seed: int, te_names: bool, pp: int = 1, vocab: int | None = None, ep: int = 1, tied: bool = False):
    """The model at tp (pp 1), or this rank's pipeline stage at pp 2 (the first stage one layer,
    the dense one: Megatron's decoder_first_pipeline_num_layers=1); the experts over ep; the
    head tied to the word embedding with `tied`."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
    stages = dict(pipeline_model_parallel_size=pp, num_layers_in_first_pipeline_stage=1, pipeline_dtype=torch.float32) if pp > 1 else {}
    config = MLATransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, tensor_model_parallel_size=tp,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
        bias_dropout_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, bias_activation_fusion=False, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, kv_channels=LATENT["v_head_dim"], num_moe_experts=EXPERTS,
        moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0, original_max_position_embeddings=4096,
        moe_layer_freq=MOE_LAYERS, expert_model_parallel_size=ep, **MTP, **DENSE, **LATENT, **MOE, **stages,
    )  # fmt: skip
    specs = [_layer_spec(EXPERTS if moe else None, te_names) for moe in MOE_LAYERS]
    offset = get_transformer_layer_offset(config)
    own = specs[offset:offset + get_num_layers_to_build(config)]  # this stage's layers, megatron-core's split
    block = TransformerBlockSubmodules(layer_specs=own, layer_norm=specs[0].submodules.input_layernorm)  # the final norm
    torch.manual_seed(seed)
    model = GPTModel(config, block, vocab_size=vocab or padded_vocab(tp), max_sequence_length=SEQ,
                     share_embeddings_and_output_weights=tied, position_embedding_type="rope",
                     pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
                     mtp_block_spec=get_gpt_mtp_block_spec(config, block, use_transformer_engine=False))  # fmt: skip
    draw_wide(model, seed)
    return model


@torch.no_grad()
def head_outputs(model) -> torch.Tensor:
    """(1 + MTP depths, B, T, padded vocabulary): the output layer's logits of tokens(), the main
    model's first, then each MTP depth's, gathered over TP. With an MTP block megatron-core's
    forward needs labels and returns losses, so the logits are taken from the head as it runs
    (it reads the MTP depths' before the main model's)."""
    from megatron.core import parallel_state

    model.eval()
    seen = []
    # a copy: megatron-core's cross-entropy turns the logits into probabilities in place
    hook = model.output_layer.register_forward_hook(lambda _module, _args, out: seen.append(out[0].clone()))
    model(*inputs(), labels=labels())
    hook.remove()
    group = parallel_state.get_tensor_model_parallel_group()
    full = []
    for local in (seen[-1], *seen[:-1]):
        shards = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(shards, local.contiguous(), group=group)
        full.append(torch.cat(shards, dim=-1).transpose(0, 1))  # (B, T, V) from Megatron's (T, B, V)
    return torch.stack(full)


def inputs_of(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids (B, T), their positions and the causal mask (True: masked), passed explicitly."""
    T = ids.shape[1]
    return ids, torch.arange(T).expand_as(ids), torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)[None, None]


@torch.no_grad()
def mtp_losses(model, ids: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> torch.Tensor:
    """megatron-core's own MTP loss of each depth on ids -> targets (default tokens() -> labels();
    what it logs as `mtp_<k> loss`), tracked by its forward in training mode."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    ids, targets = (tokens(), labels()) if ids is None else (ids, targets)
    tracker = MTPLossLoggingHelper.tracker
    tracker.clear()
    tracker["values"] = torch.zeros(MTP["mtp_num_layers"])  # on CPU (it would make it on the current CUDA device)
    # GPTModel tracks the MTP loss only when it is training; its MoE layers refuse to train at tp 2
    # without sequence parallelism, so only the top module is put in training mode (dropout is 0)
    model.eval()
    model.training = True
    model(*inputs_of(ids), labels=targets)
    model.training = False
    values = tracker["values"].clone()
    tracker.clear()
    return values


@torch.no_grad()
def batch_losses(model, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[LM loss, each MTP depth's loss] of megatron-core on a batch (the LM loss the token mean)."""
    model.eval()
    return torch.cat([model(*inputs_of(ids), labels=targets).float().mean()[None], mtp_losses(model, ids, targets)])


def save(model, directory: Path, state: dict) -> None:
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict(), **state}, str(directory))
    if dist.get_rank() == 0:
        (directory.parent / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))


def record(model, root: Path, prefix: str) -> None:
    """The model's logits, LM loss and MTP losses under ROOT/<prefix>logits.pt, ... (rank 0)."""
    out, own, mtp = head_outputs(model), loss(model), mtp_losses(model)
    if dist.get_rank() == 0:
        torch.save(out, root / f"{prefix}logits.pt")
        torch.save(own, root / f"{prefix}loss.pt")
        torch.save(mtp, root / f"{prefix}mtp_loss.pt")


def main(root: Path) -> None:
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    from tests.megatron_mla_adam import adam_oracle  # it builds on this module's model
    from tests.megatron_muon import write_mla_moe_muon_params

    patch_megatron()
    moe_utils.te_general_gemm = None
    multi_latent_attention.HAVE_TE = False  # its adapter imports without Transformer Engine (TELinear None)
    dist.init_process_group("gloo")
    tp, rank = dist.get_world_size(), dist.get_rank()
    state = trainer_state(tp, LAYERS, arch="llama", untied=True)
    vars(state["args"]).update(args_update(tp))
    model = build(tp, 1234, te_names=False)
    save(model, root / "megatron" / f"iter_{ITERATION:07d}", state)
    # Megatron-LM's legacy save: one file per tp rank, its own split of every tensor
    rank_dir = root / "megatron_per_rank" / f"iter_{ITERATION:07d}" / f"mp_rank_{rank:02d}"
    rank_dir.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.state_dict_for_save_checkpoint(), **state}, rank_dir / "model_optim_rng.pt")
    if rank == 0:
        (root / "megatron_per_rank" / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    for layer, moe in [*zip(model.decoder.layers, MOE_LAYERS), *((mtp.transformer_layer, MOE_LAYERS[-1]) for mtp in model.mtp.layers)]:
        layer.submodules_config.sharded_state_dict_keys_map = te_norm_names(moe)
    save(model, root / "megatron_te" / f"iter_{ITERATION:07d}", state)
    record(model, root, "")
    if (root / "batch.pt").is_file():  # the global batch a run resumed from this checkpoint trains on first
        losses = batch_losses(model, *torch.load(root / "batch.pt", weights_only=True))
        if rank == 0:
            torch.save(losses, root / "batch_losses.pt")
    dtgpt_out = root / "from_dtgpt"
    if dtgpt_out.is_dir():
        other = build(tp, 99, te_names=True)
        loaded = dist_checkpointing.load(other.sharded_state_dict(), str(iteration_dir(dtgpt_out)))
        other.load_state_dict(loaded, strict=False)
        record(other, root, "loaded_")
    per_rank = root / "from_dtgpt_per_rank"
    if per_rank.is_dir():  # Megatron-LM's legacy load: each rank its own file, strictly
        other = build(tp, 99, te_names=False)
        own = iteration_dir(per_rank) / f"mp_rank_{rank:02d}" / "model_optim_rng.pt"
        other.load_state_dict(torch.load(own, weights_only=False)["model"], strict=True)
        record(other, root, "loaded_per_rank_")
    write_mla_moe_muon_params(build(tp, 7, te_names=False), root / "muon_params.json")
    dist.barrier()
    parallel_state.destroy_model_parallel()
    pipeline_stages(root, state)
    if (root / "from_dtgpt_tied_pp2").is_dir():
        tied_stages(root, state)
    adam_oracle(root, state)  # last: its CPU patches of the optimizer stay
    dist.destroy_process_group()


def pipeline_stages(root: Path, state: dict) -> None:
    """Megatron-LM's per-rank save at pp 2 (tp 1, the vocabulary rows of tp 2) of the weights of
    ROOT/megatron, which each stage loads with dist_checkpointing; and the strict load of dtgpt's
    pp 2 files (to-megatron --pp 2 --decoder-first-pipeline-num-layers 1), ROOT/from_dtgpt_pp2."""
    from megatron.core import dist_checkpointing, parallel_state

    rank = dist.get_rank()
    # the stages' all-reduce of the embedding copy (the last stage's, for its MTP block) moves it to CUDA first
    torch.Tensor.cuda = lambda tensor, *args, **kwargs: tensor
    stage = build(1, 7, te_names=False, pp=2, vocab=padded_vocab(2))
    metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}  # the MTP stage's embedding copy asks
    loaded = dist_checkpointing.load(stage.sharded_state_dict(metadata=metadata), str(iteration_dir(root / "megatron")))
    stage.load_state_dict(loaded, strict=False)
    args = argparse.Namespace(**{**vars(state["args"]), "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 2,
                                 "decoder_first_pipeline_num_layers": 1})  # fmt: skip
    rank_dir = root / "megatron_pp2" / f"iter_{ITERATION:07d}" / f"mp_rank_00_{rank:03d}"
    rank_dir.mkdir(parents=True, exist_ok=True)
    torch.save({"model": stage.state_dict_for_save_checkpoint(), **state, "args": args}, rank_dir / "model_optim_rng.pt")
    if rank == 0:
        (root / "megatron_pp2" / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    dtgpt_pp2 = root / "from_dtgpt_pp2"
    if dtgpt_pp2.is_dir():  # each stage its own file, strictly: every key, shape and _extra_state
        other = build(1, 99, te_names=False, pp=2, vocab=padded_vocab(2))
        other.load_state_dict(torch.load(stage_file(dtgpt_pp2), weights_only=False)["model"], strict=True)
        (root / f"loaded_pp2_{rank}.ok").write_text("strict")
    dist.barrier()
    parallel_state.destroy_model_parallel()


def tied_stages(root: Path, state: dict) -> None:
    """megatron-core's two stages at pp 2 of the model with its head tied to the word embedding:
    each loads its file of dtgpt's to-megatron --pp 2 (ROOT/from_dtgpt_tied_pp2) strictly; run as
    a pipeline, the last writes the head's logits (the main model's, then the MTP depth's) to
    ROOT/loaded_tied_pp2_logits.pt. That stage reads the head from the embedding copy its MTP block
    uses; the output_layer.weight it also builds (and saves per rank) is never used nor trained, so
    its per-rank save, ROOT/megatron_tied_pp2, keeps that tensor at its own init, as a Megatron-LM
    run's files do. (megatron-core 0.16.1 saves no torch_dist of these stages: its
    sharded_state_dict asserts the MTP stage has no output_layer.weight.)"""
    from megatron.core import parallel_state

    rank = dist.get_rank()
    stage = build(1, 99, te_names=False, pp=2, vocab=padded_vocab(2), tied=True)
    unused_head = stage.output_layer.weight.detach().clone() if rank == 1 else None
    stage.load_state_dict(torch.load(stage_file(root / "from_dtgpt_tied_pp2"), weights_only=False)["model"], strict=True)
    stage.eval()
    with torch.no_grad():
        if rank == 0:
            dist.send(stage(*inputs()).contiguous(), dst=1)
        else:
            hidden = torch.empty(tokens().shape[1], tokens().shape[0], HIDDEN)  # (T, B, H), Megatron's
            dist.recv(hidden, src=0)
            stage.set_input_tensor(hidden)
            torch.save(head_outputs(stage), root / "loaded_tied_pp2_logits.pt")
            stage.output_layer.weight.copy_(unused_head)
    args = argparse.Namespace(**{**vars(state["args"]), "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 2,
                                 "decoder_first_pipeline_num_layers": 1, "untie_embeddings_and_output_weights": False})  # fmt: skip
    rank_dir = root / "megatron_tied_pp2" / f"iter_{ITERATION:07d}" / f"mp_rank_00_{rank:03d}"
    rank_dir.mkdir(parents=True, exist_ok=True)
    torch.save({"model": stage.state_dict_for_save_checkpoint(), **state, "args": args}, rank_dir / "model_optim_rng.pt")
    if rank == 0:
        (root / "megatron_tied_pp2" / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    dist.barrier()
    parallel_state.destroy_model_parallel()


def stage_file(saved: Path) -> Path:
    """This rank's file (tp 1, pp stage = rank) of the iteration latest_checkpointed_iteration.txt names."""
    return iteration_dir(saved) / f"mp_rank_00_{dist.get_rank():03d}" / "model_optim_rng.pt"


def iteration_dir(saved: Path) -> Path:
    """The iteration directory latest_checkpointed_iteration.txt points to."""
    return saved / f"iter_{int((saved / 'latest_checkpointed_iteration.txt').read_text()):07d}"


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    main(Path(sys.argv[1]))
