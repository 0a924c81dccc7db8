"""scripts/convert_checkpoint.py: DCP <-> torch file round trip, GPT-2 export and import.

The GPT-2 files are checked against an independent forward pass written from GPT-2's own
conventions (Conv1D weights (in, out), c_attn = [q; k; v] blocks), not just read back.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dtgpt.checkpoint import CheckpointError, gpt2, hf_files, layout
from dtgpt.checkpoint.export import load_model, read_config, read_sections
from tests import runs
from tests.test_checkpoint_resume import assert_same_tensors
from tests.checkpoints import checkpointer, make_trainer, step


def load_script():
    return runs.load_script("convert_checkpoint")


@pytest.fixture
def saved(tmp_path):
    """A trained (2 steps) one-process checkpoint with a tied head; returns (trainer, root)."""
    root = tmp_path / "ckpt"
    t = make_trainer(f"--checkpoint.save={root}", "--model.hidden_dropout=0.0")
    step(t, 2)
    checkpointer(t).save(2)
    return t, root


def test_torch_file_round_trip_is_identical_and_resumable(saved, tmp_path):
    t, root = saved
    convert = load_script()
    assert convert.main(["to-torch", str(root), str(tmp_path / "all.pt")]) == 0
    assert convert.main(["from-torch", str(tmp_path / "all.pt"), str(tmp_path / "back")]) == 0
    assert layout.read_pointer(tmp_path / "back") == 2
    assert_same_tensors(layout.iteration_dir(root, 2), layout.iteration_dir(tmp_path / "back", 2))
    data = torch.load(tmp_path / "all.pt", weights_only=True)
    assert data["iteration"] == 2 and data["config"].startswith("[model]")
    assert data["model"]["embedding.word.weight"].shape == (128, 32)
    # the converted checkpoint resumes everything, as the original would
    b = make_trainer(f"--checkpoint.load={tmp_path / 'back'}", "--model.hidden_dropout=0.0")
    checkpointer(b)
    assert b.state.progress == t.state.progress
    for p, q in zip(t.state.model.parameters(), b.state.model.parameters()):
        assert torch.equal(p, q)


def gpt2_logits(tensors: dict, hf: dict, ids: torch.Tensor) -> torch.Tensor:
    """GPT-2's forward pass written from its checkpoint conventions alone."""
    t = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    B, T = ids.shape
    C, nh, eps = hf["n_embd"], hf["n_head"], hf["layer_norm_epsilon"]
    h = t["wte.weight"][ids] + t["wpe.weight"][:T]
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(hf["n_layer"]):
        p = f"h.{i}."
        x = F.layer_norm(h, (C,), t[p + "ln_1.weight"], t[p + "ln_1.bias"], eps)
        q, k, v = (x @ t[p + "attn.c_attn.weight"] + t[p + "attn.c_attn.bias"]).split(C, dim=-1)
        q, k, v = (z.view(B, T, nh, C // nh).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-1, -2) / math.sqrt(C // nh)).masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        h = h + y @ t[p + "attn.c_proj.weight"] + t[p + "attn.c_proj.bias"]
        x = F.layer_norm(h, (C,), t[p + "ln_2.weight"], t[p + "ln_2.bias"], eps)
        m = F.gelu(x @ t[p + "mlp.c_fc.weight"] + t[p + "mlp.c_fc.bias"], approximate="tanh")
        h = h + m @ t[p + "mlp.c_proj.weight"] + t[p + "mlp.c_proj.bias"]
    h = F.layer_norm(h, (C,), t["ln_f.weight"], t["ln_f.bias"], eps)
    return h @ t["wte.weight"].t()


def test_gpt2_export_matches_gpt2_semantics_and_reads_back(saved, tmp_path):
    _, root = saved
    convert = load_script()
    assert convert.main(["to-gpt2", str(root), str(tmp_path / "hf")]) == 0
    tensors, hf = hf_files.read_hf_dir(tmp_path / "hf")
    assert hf["n_layer"] == 2 and hf["vocab_size"] == 128 and hf["activation_function"] == "gelu_new"
    assert tensors["transformer.h.0.attn.c_attn.weight"].shape == (32, 96)  # Conv1D: (in, out)
    directory = layout.iteration_dir(root, 2)
    cfg = read_config(directory)
    ours = load_model(directory, cfg).eval()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(gpt2_logits(tensors, hf, ids), ours(ids), rtol=1e-5, atol=1e-5)
    # our reader gives back exactly the stored tensors
    stored = read_sections(directory, ("model",))["model"]
    assert gpt2.from_gpt2(tensors, cfg.model, 128).keys() == stored.keys()
    for key, value in gpt2.from_gpt2(tensors, cfg.model, 128).items():
        assert torch.equal(value, stored[key]), key


def test_gpt2_import_starts_training_weights_only(saved, tmp_path):
    t, root = saved
    convert = load_script()
    assert convert.main(["to-gpt2", str(root), str(tmp_path / "hf")]) == 0
    base = tmp_path / "base.toml"
    base.write_text((layout.iteration_dir(root, 2) / layout.CONFIG).read_text())
    assert convert.main(["from-gpt2", str(tmp_path / "hf"), str(tmp_path / "imported"), "--config", str(base)]) == 0
    with pytest.raises(CheckpointError, match="holds no training state"):
        checkpointer(make_trainer(f"--checkpoint.load={tmp_path / 'imported'}"))
    b = make_trainer(f"--checkpoint.load={tmp_path / 'imported'}", "--checkpoint.load_optimizer=false")
    checkpointer(b)
    assert b.state.progress.iteration == 0
    for (name, p), q in zip(t.state.model.named_parameters(), b.state.model.parameters()):
        assert torch.equal(p, q), name


def test_plain_state_dict_with_config_converts(saved, tmp_path):
    t, root = saved
    torch.save(t.state.model.parts[0].state_dict(), tmp_path / "plain.pt")  # holds output.weight too
    config = layout.iteration_dir(root, 2) / layout.CONFIG
    convert = load_script()
    assert convert.main(["from-torch", str(tmp_path / "plain.pt"), str(tmp_path / "dcp")]) == 2  # no config
    assert convert.main(["from-torch", str(tmp_path / "plain.pt"), str(tmp_path / "dcp"), "--config", str(config)]) == 0
    directory = layout.iteration_dir(tmp_path / "dcp", 0)
    assert "model.output.weight" not in layout.read_metadata(directory).state_dict_metadata
    loaded = load_model(directory, read_config(directory))
    for (name, p), q in zip(t.state.model.parts[0].named_parameters(), loaded.parameters()):
        assert torch.equal(p, q), name


def test_from_megatron_without_config_says_what_to_pass(tmp_path, capfd):
    convert = load_script()
    assert convert.main(["from-megatron", str(tmp_path / "megatron"), str(tmp_path / "out")]) == 2
    error = capfd.readouterr().err.strip()
    assert error.startswith("error: from-megatron needs --config") and "iter_*/config.toml works" in error
    assert "\n" not in error


def test_a_missing_config_file_is_named_as_such(saved, tmp_path, capfd):
    """--config naming no file: the error names that file, not the checkpoint's own config.toml."""
    _, root = saved
    convert = load_script()
    assert convert.main(["to-gpt2", str(root), str(tmp_path / "hf"), "--config", str(tmp_path / "missing.toml")]) == 2
    assert capfd.readouterr().err.strip() == f"error: --config={tmp_path / 'missing.toml'}: no such file"



def test_from_torch_on_a_file_that_is_no_torch_file_is_one_line(tmp_path, capfd):
    """Random bytes, and a pickle that would run code (weights_only refuses it): one error line each."""
    import os
    import pickle

    class Payload:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    (tmp_path / "random.pt").write_bytes(os.urandom(4096))
    with open(tmp_path / "crafted.pt", "wb") as f:
        pickle.dump(Payload(), f, protocol=2)  # torch.load's own protocol: it reads as far as the global
    convert = load_script()
    for name in ("random.pt", "crafted.pt"):
        assert convert.main(["from-torch", str(tmp_path / name), str(tmp_path / f"out_{name}")]) == 2
        err = capfd.readouterr()
        lines = err.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {tmp_path / name} is not a torch file of tensors"), lines
        assert "pwned" not in err.out + err.err and "\x1b[" not in lines[0]
    assert "posix.system" in lines[0] or "os.system" in lines[0]  # the refused global is named
