"""Megatron's GPT family through its checkpoints, with megatron-core's GPTModel as the oracle.

megatron-core builds two 2-layer models on CPU at tp 2 and saves them as Megatron-LM's
torch_dist with Megatron-LM's args in common.pt (tests/megatron_gpt.py):
- "rope": GPT-3 with RoPE in Megatron's default convention (channel i rotates with i + d/2);
- "llama": Llama-style: RMSNorm, SwiGLU, 2 query groups over 4 heads, no biases, RoPE, untied head;
- "mqa": one key/value group for 4 heads, which both tp ranks of Megatron (and of dtgpt) share;
- "options": the other options at once: qk-layernorm, 32-channel heads over hidden 64
  (kv_channels), RoPE on half of each head in interleaved pairs with Llama 3.1's scaling, the
  exact GeLU, a QKV bias without the others.
dtgpt loads each into one process, at pp2 and at tp2 + SP and must give Megatron's logits; a [model] that
differs from the checkpoint's args is one error naming the key; use_checkpoint_args takes them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dtgpt
from dtgpt.checkpoint import Checkpointer, CheckpointError, layout
from dtgpt.checkpoint.architecture import architecture, megatron_architecture
from dtgpt.checkpoint.checkpoint_args import with_checkpoint_architecture
from dtgpt.checkpoint.export import load_model, read_config
from dtgpt.checkpoint.megatron import find, load_megatron_model
from dtgpt.checkpoint.megatron.reader import MegatronReader
from dtgpt.config import ModelConfig, load_config
from tests.megatron_gpt import ITERATION, LLAMA_FFN, LLAMA_GROUPS, OPTIONS_KV_CHANNELS, SEQ, VOCAB, tokens
from tests.megatron_oracle import run_megatron_gpt
from tests.runs import run_train
from tests.test_checkpoint_convert import load_script

pytestmark = pytest.mark.slow

ROWS = 128  # Megatron's padding at tp 2: 100 -> a multiple of 16 x 2
ARCHS = {
    "rope": dict(position_embedding_type="rope"),
    "llama": dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                  group_query_attention=True, num_query_groups=LLAMA_GROUPS, ffn_hidden_size=LLAMA_FFN,
                  untie_embeddings_and_output_weights=True),
    "mqa": dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                group_query_attention=True, num_query_groups=1, ffn_hidden_size=LLAMA_FFN),
    "options": dict(position_embedding_type="rope", kv_channels=OPTIONS_KV_CHANNELS, qk_layernorm=True, rotary_interleaved=True,
                    rotary_percent=0.5, use_rope_scaling=True, add_bias_linear=False, add_qkv_bias=True),
}  # fmt: skip
WORKER = Path(__file__).with_name("megatron_family_worker.py")


def model_cfg(arch: str, **overrides) -> ModelConfig:
    fields = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=SEQ, hidden_dropout=0.0,
                  attention_dropout=0.0, make_vocab_size_divisible_by=32)  # fmt: skip
    return ModelConfig(**{**fields, **ARCHS[arch], **overrides})


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    ours, theirs = ours[..., :VOCAB], theirs[..., :VOCAB]
    return ((ours - theirs).norm() / theirs.norm()).item()


@pytest.fixture(scope="module")
def saved(family) -> dict[str, Path]:
    return {arch: family / arch for arch in ARCHS}


def test_megatron_family_checkpoints_give_megatrons_logits_in_one_process_at_pp2_and_at_tp2(saved):
    for arch, root in saved.items():
        directory = find(root)
        assert megatron_architecture(MegatronReader(directory).common["args"]) == architecture(model_cfg(arch))
        with torch.no_grad():
            ours = load_megatron_model(directory, model_cfg(arch), ROWS).eval()(tokens())
        assert relative_error(ours, torch.load(root / "logits.pt", weights_only=True)) < 1e-5, arch
    jobs = [(str(root), {**ARCHS[arch], "make_vocab_size_divisible_by": 32}) for arch, root in saved.items()]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER), json.dumps(jobs)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for arch, root in saved.items():
        for mesh in ("pp2", "tp2"):
            ours = torch.load(root / f"{mesh}_logits.pt", weights_only=True)
            assert relative_error(ours, torch.load(root / "logits.pt", weights_only=True)) < 1e-5, (arch, mesh)


@pytest.mark.parametrize(
    "arch, overrides, message",
    [
        ("rope", dict(rotary_interleaved=True), "model.rotary_interleaved: the checkpoint has false but the config has true; "
                                                "set model.rotary_interleaved=false"),
        ("llama", dict(swiglu=False, ffn_hidden_size=LLAMA_FFN), "model.swiglu: the checkpoint has true but the config has false"),
        ("llama", dict(group_query_attention=False), "model.num_query_groups: the checkpoint has 2 but the config has 4; "
                                                     "set model.group_query_attention=true and model.num_query_groups=2"),
        ("llama", dict(normalization="LayerNorm"), "model.normalization: the checkpoint has 'RMSNorm' but the config has 'LayerNorm'"),
        ("llama", dict(add_bias_linear=True), "model.add_bias_linear: the checkpoint has false but the config has true"),
        ("rope", dict(bias_gelu_fusion=False), "model.gelu: the checkpoint has 'tanh' but the config has 'none'; "
                                               "set model.bias_gelu_fusion=true (and model.openai_gelu=false) for the 'tanh' GeLU"),
    ],
)  # fmt: skip
def test_a_model_other_than_the_checkpoints_args_is_refused_naming_the_key(saved, arch, overrides, message):
    with pytest.raises(CheckpointError) as e:
        load_megatron_model(find(saved[arch]), model_cfg(arch, **overrides), ROWS)
    assert str(e.value).startswith(f"Megatron checkpoint {find(saved[arch])}: {message}")
    assert str(e.value).endswith("or checkpoint.use_checkpoint_args=true to take the checkpoint's architecture")


RUN = [
    "--model.num_layers=2", "--model.hidden_size=64", "--model.num_attention_heads=4", f"--model.seq_length={SEQ}",
    "--model.hidden_dropout=0.0", "--model.attention_dropout=0.0", "--model.make_vocab_size_divisible_by=32",
    "--data.mock_data=true", "--data.tokenizer_type=NullTokenizer", f"--data.vocab_size={VOCAB}",
    "--training.micro_batch_size=2", "--training.global_batch_size=8", "--optimizer.lr=1e-3", "--logging.log_interval=1",
]  # fmt: skip


def test_train_py_names_the_key_or_takes_the_checkpoints_architecture(saved, tmp_path):
    """A GPT-3 [model] against the Llama-style checkpoint: one error line naming the first key
    that differs; with checkpoint.use_checkpoint_args the run takes Megatron's architecture and
    trains on from its iteration."""
    load = [f"--checkpoint.load={saved['llama']}", f"--training.train_iters={ITERATION + 2}"]
    proc = run_train(tmp_path, [*RUN, *load], check=False, name="refused")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(errors) == 1 and "model.ffn_hidden_size: the checkpoint has 128 but the config has 256" in errors[0], errors
    run_train(tmp_path, [*RUN, *load, "--checkpoint.use_checkpoint_args=true"], name="taken")
    log = (tmp_path / "taken.log").read_text()
    directory = find(saved["llama"])
    assert f"> the model's architecture is {directory}'s (checkpoint.use_checkpoint_args)" in log
    assert f"> loaded Megatron checkpoint {directory}: iteration {ITERATION}" in log
    assert f"iteration {ITERATION + 2:>8}/{ITERATION + 2:>8}" in log


def test_llama_per_rank_format_gives_megatrons_logits(family):
    """Megatron-LM's per-rank files of the Llama-style model at tp 2: each rank's linear_fc1 is
    [its gate rows; its fc1 rows], glued into [gate; fc1]."""
    root = family / "llama_per_rank"
    with torch.no_grad():
        ours = load_megatron_model(find(root), model_cfg("llama"), ROWS).eval()(tokens())
    assert relative_error(ours, torch.load(root / "logits.pt", weights_only=True)) < 1e-5


def test_llama_dtgpt_checkpoint_converts_to_megatron_tp2_with_equal_logits(tmp_path):
    """dtgpt trains a Llama-style model and saves; to-megatron writes torch_dist with the
    architecture in args; megatron-core's Llama-style GPTModel at tp 2 loads it with equal logits."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "megatron"
    llama = [f"--model.{key}={str(value).lower() if isinstance(value, bool) else value}" for key, value in ARCHS["llama"].items()]
    run_train(tmp_path, [*RUN, *llama, "--training.train_iters=2", f"--checkpoint.save={ckpt}"])
    assert load_script().main(["to-megatron", str(ckpt), str(out), "--tp", "2"]) == 0
    cfg = read_config(layout.iteration_dir(ckpt, 2))
    assert megatron_architecture(MegatronReader(find(out)).common["args"]) == architecture(cfg.model)
    run_megatron_gpt("load", out, 2, "--arch", "llama", "--untied")
    with torch.no_grad():
        ours = load_model(layout.iteration_dir(ckpt, 2), cfg).eval()(tokens())
    assert relative_error(ours, torch.load(out / "loaded_logits.pt", weights_only=True)) < 1e-5


def test_dtgpt_gives_muon_the_parameters_megatron_cores_builder_gives_it(family):
    """megatron-core's get_megatron_muon_optimizer on its GPTModel (tests/megatron_muon.py, in the
    family launch) against dtgpt's build_optimizer on dtgpt's model of the same shape: the same
    matrices take Muon (names mapped; SwiGLU's gate and fc1 are Megatron's one linear_fc1) and the
    same are split as QKV."""
    from dtgpt.checkpoint.megatron.keys import megatron_name
    from dtgpt.config import OptimizerConfig
    from dtgpt.model import GPT
    from dtgpt.muon import MUON, muon_matrices
    from dtgpt.optim import build_optimizer
    from tests.megatron_muon import MUON_ARCHS

    found = family / "muon_params.json"
    if not found.exists():
        pytest.skip("megatron-core's Muon builder needs emerging-optimizers (make setup) and megatron-core 0.16.1")
    megatron = json.loads(found.read_text())
    for arch, untied in MUON_ARCHS:
        # "gpt": GPT-3 itself, RoPE's model with learned absolute positions
        cfg = model_cfg(arch, untie_embeddings_and_output_weights=untied) if arch != "gpt" else model_cfg("rope", position_embedding_type="learned_absolute")
        with torch.device("meta"):
            model = GPT(cfg, ROWS)
        names = {id(p): name for name, p in model.named_parameters()}
        optimizer = build_optimizer(model.named_parameters(), OptimizerConfig(optimizer="muon"), matrices=muon_matrices(model))
        muon = [p for g in optimizer.param_groups if g.get(MUON) for p in g["params"]]
        ours = {megatron_name(names[id(p)], per_layer=True)[0] for p in muon}  # gate and fc1: linear_fc1
        qkv = {megatron_name(names[id(p)], per_layer=True)[0] for p in muon if id(p) in muon_matrices(model).qkv_splits}
        assert sorted(ours) == megatron[arch]["muon"], arch
        assert sorted(qkv) == megatron[arch]["qkv"], arch
    assert "embedding.position_embeddings.weight" in megatron["gpt"]["muon"]  # a matrix Megatron does not exempt


def test_a_rope_checkpoint_saved_before_rotary_interleaved_keeps_its_convention(tmp_path):
    """dtgpt rotated interleaved pairs before model.rotary_interleaved existed (its default is
    now Megatron's halves). A checkpoint whose saved config lacks the key is read as interleaved:
    resuming it with the new default is refused naming the key, and use_checkpoint_args resumes."""
    ckpt = tmp_path / "ckpt"
    rope = [*RUN, "--model.position_embedding_type=rope", "--model.rotary_interleaved=true", f"--checkpoint.save={ckpt}"]
    run_train(tmp_path, [*rope, "--training.train_iters=2"], name="first")
    saved = layout.iteration_dir(ckpt, 2) / layout.CONFIG
    saved.write_text("".join(line for line in saved.read_text().splitlines(keepends=True) if not line.startswith("rotary_interleaved")))
    marker = layout.read_marker(saved.parent)
    layout.write_marker(saved.parent, {k: v for k, v in marker.items() if k != "checksums"})  # as that dtgpt wrote it
    assert read_config(layout.iteration_dir(ckpt, 2)).model.rotary_interleaved is True
    # the same run resumed with the new default (load only: a save directory is locked by its Checkpointer)
    resume = [*RUN, "--model.position_embedding_type=rope", f"--checkpoint.load={ckpt}", "--training.train_iters=3",
              "--optimizer.override_opt_param_scheduler=true"]  # a longer run: its LR decay follows train_iters
    cfg = load_config(None, resume)
    runtime = dtgpt.init_distributed(cfg)
    try:
        state = dtgpt.build_train_state(cfg, dtgpt.build_model(cfg, runtime, VOCAB))
        with pytest.raises(CheckpointError, match="model.rotary_interleaved: the checkpoint has true but the config has false"):
            Checkpointer(state, cfg, runtime)
        taken, note = with_checkpoint_architecture(load_config(None, [*resume, "--checkpoint.use_checkpoint_args=true"]))
        assert taken.model.rotary_interleaved is True and "checkpoint.use_checkpoint_args" in note
        state = dtgpt.build_train_state(taken, dtgpt.build_model(taken, runtime, VOCAB))
        assert Checkpointer(state, taken, runtime).state.progress.iteration == 2
    finally:
        dtgpt.shutdown()
