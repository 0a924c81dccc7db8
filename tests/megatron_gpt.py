"""megatron-core's own GPTModel on CPU: the oracle for Megatron checkpoints in and out.

Run as a script, one process or under torchrun (gloo, one rank per TP rank):

    python tests/megatron_gpt.py save DIR [--untied] [--arch A]  build, save Megatron-LM's torch_dist
                                                          iteration, write DIR/logits.pt and
                                                          DIR/loss.pt (its own loss on labels())
    python tests/megatron_gpt.py bf16 DIR                 as save, and DIR/bf16_logits.pt: the same
                                                          model in Megatron's bf16 (Float16Module)
    python tests/megatron_gpt.py per-rank DIR [--layers N]  the same weights in the per-rank format
    python tests/megatron_gpt.py load DIR                 load DIR's checkpoint, write DIR/loaded_logits.pt
                                                          (and DIR/per_rank_pp2's tied stages at pp 2:
                                                          tests/megatron_tied_stages.py)
    python tests/megatron_gpt.py adam DIR                 one AdamW step of the distributed optimizer,
                                                          save model + optimizer, write DIR/adam.pt
                                                          (state saved, and after one more step)
    python tests/megatron_gpt.py load-adam DIR            load model + optimizer, write DIR/loaded_adam.pt
                                                          (--sharding fully_reshardable dp_reshardable: adam also
                                                          saves the same state in Megatron's default layout
                                                          under DIR/dp_reshardable; load-adam loads the first;
                                                          --dp 2 on 2 ranks: tp 1, dp 2, checkpoints only)
    python tests/megatron_gpt.py sgd DIR                  save the weights, then step its optimizer='sgd'
                                                          three times, write DIR/sgd.pt; the same with its
                                                          Muon, saved after one step (tests/megatron_muon.py)
    python tests/megatron_gpt.py family DIR               save each of FAMILY's models under DIR/<arch>, and
                                                          the Llama-style one's Muon state (DIR/llama_muon)
    python tests/megatron_gpt.py adam-parallel DIR        on 4 ranks (tp 2 x pp 2, and with VIRTUAL_ADAM's virtual stages): one distributed-optimizer
                                                          step of each of PARALLEL_ADAM's models, saved
                                                          model space, dp_reshardable and per rank with each
                                                          rank's distrib_optim.pt (run_adam_parallel); then the
                                                          MoE model's at tp 2 under DIR/moe_tp2, and at pp 2 under
                                                          DIR/moe_vp (virtual stages) and DIR/moe_tp2pp2
                                                          (tests/megatron_moe_adam.py save_moe_adam_tp2,
                                                          save_moe_adam_pipeline)

megatron-core runs on CPU with four patches (what it assumes of CUDA, none of its numerics):
no RNG tracker fork (dropout is 0), torch.cuda.current_device -> "cpu", torch.cuda.synchronize a
no-op, and its async writer's psutil memory probe and spawned result queue replaced (the save
otherwise hangs or needs psutil). The causal mask is passed explicitly (its default is built on
"cuda"). Kept in its own process so none of this leaks into the test process. The optimizer
commands (tests/megatron_adam.py) patch a little more.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

VOCAB = 100  # the tokenizer's; Megatron pads it to DIVISIBLE_BY * tp rows
DIVISIBLE_BY = 16
LAYERS, HIDDEN, HEADS, SEQ = 2, 64, 4, 32
VIRTUAL_LAYERS, VIRTUAL_STAGES = 4, 2  # adam-parallel's interleaved save: one layer per virtual stage at pp 2
ITERATION, CONSUMED, LR_SAMPLES = 7, 56, 48
CONSUMED_VALID = 24  # Megatron-LM keeps args.consumed_valid_samples in every checkpoint


def patch_megatron() -> None:
    """The CPU patches of the module doc; only the script calls this (never a test process)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.tensor_parallel import random as megatron_random

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    filesystem_async._process_memory = lambda: 0
    filesystem_async._get_write_results_queue = lambda: multiprocessing.get_context("fork").Manager().Queue()
    megatron_random.CudaRNGStatesTracker.fork = lambda self, *args, **kwargs: contextlib.nullcontext()


def padded_vocab(tp: int) -> int:
    multiple = DIVISIBLE_BY * tp
    return -(-VOCAB // multiple) * multiple


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))


def labels() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))


LLAMA_FFN, LLAMA_GROUPS = 128, 2
OPTIONS_KV_CHANNELS = 32  # 4 heads of 32 channels over a hidden size of 64

ROPE_ARGS = dict(position_embedding_type="rope", rotary_interleaved=False, rotary_percent=1.0, rotary_base=10000,
                 use_rope_scaling=False, rope_scaling_factor=8.0)  # fmt: skip
ARCHS = {
    # name: TransformerConfig fields ("config"), GPTModel's keywords ("model"), the local layer
    # spec's ("spec"), and the Megatron-LM args that describe the model in common.pt ("args")
    "gpt": dict(config=dict(ffn_hidden_size=4 * HIDDEN, bias_activation_fusion=True),  # the tanh GeLU, as GPT-3 runs
                model=dict(position_embedding_type="learned_absolute"),
                args=dict(ffn_hidden_size=4 * HIDDEN, position_embedding_type="learned_absolute")),
    # GPT-3 with RoPE in Megatron's default convention (rotary_interleaved False: channel i with i + d/2)
    "rope": dict(config=dict(ffn_hidden_size=4 * HIDDEN, bias_activation_fusion=True), model=dict(position_embedding_type="rope"),
                 args=dict(ffn_hidden_size=4 * HIDDEN, **ROPE_ARGS)),
    # Llama-style: RMSNorm, SwiGLU, grouped-query attention, no biases, RoPE (the head untied by --untied)
    "llama": dict(config=dict(ffn_hidden_size=LLAMA_FFN, normalization="RMSNorm", gated_linear_unit=True,
                              activation_func=torch.nn.functional.silu, add_bias_linear=False,
                              num_query_groups=LLAMA_GROUPS, bias_activation_fusion=False),
                  model=dict(position_embedding_type="rope"),
                  args=dict(ffn_hidden_size=LLAMA_FFN, normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                            add_qkv_bias=False, bias_gelu_fusion=False, group_query_attention=True,
                            num_query_groups=LLAMA_GROUPS, **ROPE_ARGS)),
    # multi-query: one key/value group, which Megatron replicates over tp ranks (their QKV output gathered)
    "mqa": dict(config=dict(ffn_hidden_size=LLAMA_FFN, normalization="RMSNorm", gated_linear_unit=True,
                            activation_func=torch.nn.functional.silu, add_bias_linear=False, num_query_groups=1,
                            bias_activation_fusion=False),
                model=dict(position_embedding_type="rope"),
                args=dict(ffn_hidden_size=LLAMA_FFN, normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                          add_qkv_bias=False, bias_gelu_fusion=False, group_query_attention=True, num_query_groups=1,
                          **ROPE_ARGS)),
    # the other options at once: qk-layernorm, wider heads (kv_channels), RoPE on half of each head's
    # channels in interleaved pairs with Llama 3.1's scaling, the exact GeLU, a QKV bias alone
    "options": dict(config=dict(ffn_hidden_size=4 * HIDDEN, kv_channels=OPTIONS_KV_CHANNELS, qk_layernorm=True,
                                rotary_interleaved=True, add_bias_linear=False, add_qkv_bias=True,
                                bias_activation_fusion=False),
                    model=dict(position_embedding_type="rope", rotary_percent=0.5, rope_scaling=True),
                    spec=dict(qk_layernorm=True),
                    args=dict(ffn_hidden_size=4 * HIDDEN, kv_channels=OPTIONS_KV_CHANNELS, qk_layernorm=True,
                              add_bias_linear=False, add_qkv_bias=True, bias_gelu_fusion=False,
                              **{**ROPE_ARGS, "rotary_interleaved": True, "rotary_percent": 0.5, "use_rope_scaling": True})),
}  # fmt: skip


def build(tp: int, untied: bool, layers: int = LAYERS, arch: str = "gpt", pp: int = 1, vp: int | None = None):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vp)
    return new_model(tp, untied, layers, arch) if vp is None else virtual_chunks(tp, untied, layers, arch)


def virtual_chunks(tp: int, untied: bool, layers: int, arch: str) -> list:
    """This pp rank's model chunks under virtual pipelining (Megatron-LM's get_model: one GPTModel
    per virtual stage, the embedding in chunk 0 of the first pp rank, the head in the last chunk
    of the last), each seeded apart so that no two chunks hold equal weights."""
    from megatron.core import parallel_state

    vp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    return [new_model(tp, untied, layers, arch, vp_stage=stage) for stage in range(vp)]


def new_model(tp: int, untied: bool, layers: int = LAYERS, arch: str = "gpt", vp_stage: int | None = None):
    """The GPTModel (this rank's pipeline stage; its virtual stage `vp_stage` of several), seeded:
    every call gives the same weights (model parallelism set up)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    vp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    config = TransformerConfig(
        num_layers=layers, virtual_pipeline_model_parallel_size=vp, hidden_size=HIDDEN, num_attention_heads=HEADS,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(), pipeline_dtype=torch.float32,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=0.02, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False, **ARCHS[arch]["config"],
    )  # fmt: skip
    torch.manual_seed(1234 + (vp_stage or 0))
    model = GPTModel(config, get_gpt_layer_local_spec(**ARCHS[arch].get("spec", {})), vocab_size=padded_vocab(tp),
                     max_sequence_length=SEQ, share_embeddings_and_output_weights=not untied,
                     pre_process=parallel_state.is_pipeline_first_stage(False, vp_stage),
                     post_process=parallel_state.is_pipeline_last_stage(False, vp_stage), vp_stage=vp_stage, **ARCHS[arch]["model"])  # fmt: skip
    if arch != "gpt" or vp_stage is not None:  # the tolerances of the GPT-3 model's tests were derived at Megatron's init
        with torch.no_grad():  # norms start at one and biases at zero: give them values a mix-up would show
            for name, p in model.named_parameters():
                if "layernorm" in name or name.endswith("bias"):
                    p.uniform_(0.5, 1.5)
    return model


def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens(), their positions, and the causal mask (True: masked), passed explicitly."""
    ids = tokens()
    T = ids.shape[1]
    return ids, torch.arange(T).expand_as(ids), torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)[None, None]


@torch.no_grad()
def loss(model) -> torch.Tensor:
    """megatron-core's own language-model loss of tokens() -> labels(), the mean over tokens
    (its vocabulary-parallel cross-entropy over every padded row)."""
    model.eval()
    per_token = model(*inputs(), labels=labels())  # (B, T)
    return per_token.float().mean()


@torch.no_grad()
def logits(model) -> torch.Tensor:
    """Full logits (B, T, padded vocabulary): the vocabulary-parallel shards gathered over TP."""
    from megatron.core import parallel_state

    model.eval()
    local = model(*inputs())
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1:
        return local
    shards = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(shards, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(shards, dim=-1)


def trainer_state(tp: int, layers: int = LAYERS, arch: str = "gpt", untied: bool = False, pp: int = 1) -> dict:
    """What Megatron-LM's trainer saves next to the model (its common.pt part), its args
    describing the architecture as Megatron-LM's do."""
    args = argparse.Namespace(consumed_train_samples=CONSUMED, consumed_valid_samples=CONSUMED_VALID,
                              tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, num_layers=layers, hidden_size=HIDDEN,
                              num_attention_heads=HEADS, kv_channels=HIDDEN // HEADS, normalization="LayerNorm",
                              norm_epsilon=1e-5, swiglu=False, add_bias_linear=True, add_qkv_bias=True,
                              bias_gelu_fusion=True, openai_gelu=False, group_query_attention=False, num_query_groups=1,
                              apply_layernorm_1p=False, qk_layernorm=False, untie_embeddings_and_output_weights=untied,
                              make_vocab_size_divisible_by=DIVISIBLE_BY, padded_vocab_size=padded_vocab(tp))  # fmt: skip
    vars(args).update(ARCHS[arch]["args"])
    return {"iteration": ITERATION, "checkpoint_version": 3.0, "args": args,
            "opt_param_scheduler": {"num_steps": LR_SAMPLES, "max_lr": 1e-3, "min_lr": 1e-4}}  # fmt: skip


PARALLEL_ADAM = (("gpt", False), ("llama", True))
"""What adam-parallel saves at tp 2 x pp 2, each under ROOT/<arch>: (architecture, untied head)."""
VIRTUAL_ADAM = ("gpt_vp", VIRTUAL_LAYERS, VIRTUAL_STAGES)
"""What adam-parallel saves besides, at tp 2 x pp 2 with virtual stages, under ROOT/gpt_vp: (name, layers,
virtual stages per pp rank) of the tied GPT, its norms and biases drawn (new_model) so that no two chunks match."""

FAMILY = (("rope", "save", False), ("llama", "save", True), ("options", "save", False), ("mqa", "save", False),
          ("llama", "per-rank", True))
"""What the `family` command saves in one launch: (architecture, save command, untied head), each
under ROOT/<arch> (the per-rank one under ROOT/<arch>_per_rank)."""


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=("save", "bf16", "per-rank", "load", "adam", "load-adam", "sgd", "family", "adam-parallel"))
    parser.add_argument("root")
    parser.add_argument("--untied", action="store_true")
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--arch", choices=sorted(ARCHS), default="gpt")
    parser.add_argument("--dp", type=int, default=1, help="adam: data-parallel ranks (tp = the ranks / dp)")
    parser.add_argument("--sharding", nargs="+", choices=("fully_reshardable", "dp_reshardable"), default=["fully_reshardable"],
                        help="adam: the distributed optimizer's distrib_optim_sharding_type, the first under DIR, any other under DIR/<type>")
    parser.add_argument("--per-rank", action="store_true", help="adam: the states in Megatron-LM's per-rank format too (tests/megatron_adam.py)")
    args = parser.parse_args(argv)
    patch_megatron()
    dist.init_process_group("gloo")
    root = Path(args.root)
    if args.command == "adam-parallel":  # on 4 ranks: tp 2 x pp 2
        from megatron.core import parallel_state

        from tests.megatron_adam import patch_for_optimizer, run_adam_parallel

        patch_for_optimizer()  # before the build too: a tied head's last-stage copy is moved with .cuda()
        for arch, untied in PARALLEL_ADAM:
            model = build(2, untied, LAYERS, arch, pp=2)
            run_adam_parallel(model, root / arch, trainer_state(2, LAYERS, arch, untied, pp=2), twin=lambda: new_model(2, untied, LAYERS, arch))
            parallel_state.destroy_model_parallel()
        name, layers, vp = VIRTUAL_ADAM
        chunks = build(2, False, layers, pp=2, vp=vp)
        state = trainer_state(2, layers, untied=False, pp=2)
        vars(state["args"]).update(virtual_pipeline_model_parallel_size=vp)  # as Megatron-LM's args name it
        run_adam_parallel(chunks, root / name, state, twin=lambda: virtual_chunks(2, False, layers, "gpt"))
        parallel_state.destroy_model_parallel()
        from tests.megatron_moe_adam import save_moe_adam_pipeline, save_moe_adam_tp2

        save_moe_adam_tp2(root / "moe_tp2")  # the MoE model's Adam state at tp 2, in the same launch
        save_moe_adam_pipeline(root)  # and at pp 2: with virtual stages, and at tp 2 x pp 2
    elif args.command == "family":  # several models in one launch: megatron-core's import is paid once
        from megatron.core import parallel_state

        for arch, command, untied in FAMILY:
            run(command, root / (arch if command == "save" else f"{arch}_{command.replace('-', '_')}"), untied, args.layers, arch, args.sharding, args.dp)
            parallel_state.destroy_model_parallel()
        from tests.megatron_muon import save_muon_tp2, write_muon_params

        write_muon_params(root / "muon_params.json")  # the parameters its Muon builder takes (tests/megatron_muon.py)
        save_muon_tp2(root / "llama_muon")  # and its Muon chain's state saved at tp 2
    else:
        run(args.command, root, args.untied, args.layers, args.arch, args.sharding, args.dp, args.per_rank)
    dist.destroy_process_group()


def run(command: str, root: Path, untied: bool, layers: int, arch: str, sharding: tuple[str, ...] = ("fully_reshardable",), dp: int = 1,
        per_rank: bool = False) -> None:
    """One command on one model (see the module docstring)."""
    from megatron.core import dist_checkpointing

    tp, rank = dist.get_world_size() // dp, dist.get_rank()
    model = build(tp, untied, layers, arch)
    state = trainer_state(tp, layers, arch, untied)
    if command in ("adam", "load-adam", "sgd"):
        from tests.megatron_adam import run_adam

        run_adam(command, model, root, state, tuple(sharding), twin=lambda: new_model(tp, untied, layers, arch), per_rank=per_rank)
        return
    pointer = root / "latest_checkpointed_iteration.txt"
    iteration = int(pointer.read_text()) if command == "load" else ITERATION
    directory = root / f"iter_{iteration:07d}"
    if command in ("save", "bf16"):
        if rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save({"model": model.sharded_state_dict(), **state}, str(directory))
    elif command == "per-rank":
        # Megatron-LM's legacy save: one torch.save per model-parallel rank, per-layer keys.
        rank_dir = directory / f"mp_rank_{rank:02d}"
        rank_dir.mkdir(parents=True, exist_ok=True)
        torch.save({"model": model.state_dict_for_save_checkpoint(), **state}, rank_dir / "model_optim_rng.pt")
    else:
        loaded = dist_checkpointing.load(model.sharded_state_dict(), str(directory))
        model.load_state_dict(loaded, strict=False)
    out = logits(model)
    own_loss = loss(model) if command in ("save", "bf16") else None
    if command == "bf16":
        from megatron.core.transformer.module import Float16Module

        model.config.bf16 = True
        bf16_out = logits(Float16Module(model.config, model))  # the module in bf16, its logits in fp32
        if rank == 0:
            torch.save(bf16_out, root / "bf16_logits.pt")
    if rank == 0:
        pointer.write_text(str(iteration))
        torch.save(out, root / ("loaded_logits.pt" if command == "load" else "logits.pt"))
        if own_loss is not None:
            torch.save(own_loss, root / "loss.pt")
    dist.barrier()
    if command == "load" and (root / "per_rank_pp2").is_dir():
        from tests.megatron_tied_stages import load_tied_stages

        load_tied_stages(root)


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.megatron_adam
    main(sys.argv[1:])
