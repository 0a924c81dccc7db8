"""What only CUDA can show, skipped without it (`cuda` marker; every other test pins the CPU:
tests/conftest.py). scripts/gpu_check.sh runs them on a GPU machine (its suite step, after the benchmark)."""

from __future__ import annotations

import pytest
import torch

import dtgpt
from dtgpt.checkpoint import layout
from tests.checkpoints import assert_same, checkpointer, flat_state, make_trainer, step

pytestmark = pytest.mark.cuda
ON_CUDA = "--training.device=cuda"


def both_rng_states() -> tuple[torch.Tensor, torch.Tensor]:
    """Dropout on CUDA draws from the device's generator, not the CPU's."""
    return torch.get_rng_state(), torch.cuda.get_rng_state()


def set_both_rng_states(states: tuple[torch.Tensor, torch.Tensor]) -> None:
    torch.set_rng_state(states[0])
    torch.cuda.set_rng_state(states[1])


def test_save_and_load_restore_every_tensor_exactly_on_cuda(tmp_path):
    a = make_trainer(ON_CUDA, f"--checkpoint.save={tmp_path}")
    assert a.state.model.device.type == "cuda"
    step(a, 3)
    ckpt = checkpointer(a)
    ckpt.save(3)
    ckpt.finalize()
    rng = both_rng_states()
    torch.manual_seed(999)
    b = make_trainer(ON_CUDA, f"--checkpoint.load={tmp_path}")
    checkpointer(b).restore_rng()
    assert_same(flat_state(a), flat_state(b))
    assert torch.equal(torch.cuda.get_rng_state(), rng[1])
    step(a)  # both continue identically from the same generator states
    set_both_rng_states(rng)
    step(b)
    assert_same(flat_state(a), flat_state(b))
    dtgpt.shutdown()


def test_async_saves_follow_one_another_on_cuda(tmp_path):
    t = make_trainer(ON_CUDA, f"--checkpoint.save={tmp_path}", "--checkpoint.async_save=true", "--training.bf16=true")
    ckpt = checkpointer(t)
    for i in range(1, 4):  # the stager copies again and again (torch 2.11 closed it after each copy)
        step(t)
        ckpt.save(i)
    ckpt.finalize()
    assert layout.read_pointer(tmp_path) == 3
    dtgpt.shutdown()


def test_the_library_moves_its_own_batch_to_the_models_device():
    cfg = dtgpt.make_config(
        model=dict(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8, hidden_dropout=0.0, attention_dropout=0.0),
        data=dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=32, num_workers=0),
        training=dict(micro_batch_size=2, global_batch_size=4, train_iters=1, device="cuda"),
    )
    model = dtgpt.build_model(cfg, dtgpt.init_distributed(cfg), vocab_size=32)
    batch = next(dtgpt.build_train_iterator(cfg, model))  # on the host, as the loader gives it
    loss = dtgpt.forward_backward(model, batch, 2, forward_only=True)
    with torch.no_grad():
        logits = model.parts[0](batch.tokens.to(model.device))
        plain = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch.labels.to(model.device).flatten()).item()
    assert loss == pytest.approx(plain, rel=1e-5)
    dtgpt.shutdown()
