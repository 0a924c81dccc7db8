"""The library API and examples/simple_train_loop.py (issue: a Megatron-Core-style loop)."""

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

import dtgpt
from dtgpt.config import load_config
from tests.runs import REPO, TINY, Command, launch_commands, read_metrics

EXAMPLE = REPO / "examples/simple_train_loop.py"


def one_process_losses() -> list[float]:
    """The example's loop at tp 1 in this process (no process group)."""
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import simple_train_loop as ex
    finally:
        sys.path.pop(0)
    cfg = dtgpt.make_config(model=ex.MODEL, data=ex.DATA, training=ex.TRAINING)
    runtime = dtgpt.init_distributed(cfg)
    model = dtgpt.build_model(cfg, runtime, vocab_size=100)
    batches = dtgpt.build_train_iterator(cfg, model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        losses.append(dtgpt.forward_backward(model, next(batches), dtgpt.num_microbatches(cfg, model.dims.dp)))
        optimizer.step()
    return losses


def test_example_is_short():
    assert len(EXAMPLE.read_text().splitlines()) <= 80


@pytest.mark.slow
def test_example_under_torchrun_matches_one_process(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(EXAMPLE), str(tmp_path / "ckpt")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = [float(x) for x in re.findall(r"iteration \d: loss ([0-9.]+)", proc.stdout)]
    assert len(printed) == 5
    assert "into a TP 1 model: all 28 tensors equal" in proc.stdout
    assert (tmp_path / "ckpt" / "iter_0000005").is_dir()
    assert printed == pytest.approx(one_process_losses(), abs=2e-6)


def test_forward_backward_returns_the_global_loss():
    cfg = dtgpt.make_config(
        model=dict(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8, hidden_dropout=0.0, attention_dropout=0.0),
        data=dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=32, num_workers=0),
        training=dict(micro_batch_size=2, global_batch_size=4, train_iters=1),
    )
    runtime = dtgpt.init_distributed(cfg)
    model = dtgpt.build_model(cfg, runtime, vocab_size=32)
    batch = next(dtgpt.build_train_iterator(cfg, model))
    loss = dtgpt.forward_backward(model, batch, 2, forward_only=True)
    with torch.no_grad():
        logits = model.parts[0](batch.tokens)
        plain = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.labels.flatten()).item()
    assert loss == pytest.approx(plain, rel=1e-6)
    with pytest.raises(Exception, match="unknown key model.layers"):
        dtgpt.make_config(model=dict(layers=2))


# Everything a resume must carry matters here: dropout draws (RNG), warmup then cosine decay
# (LR schedule), fp16 overflows that skip iterations and lower the scale (loss scaler).
RESUMED = ["--training.train_iters=8", "--model.hidden_dropout=0.1", "--training.fp16=true",
           "--training.micro_batch_size=4", "--optimizer.initial_loss_scale=1048576", "--optimizer.loss_scale_window=3"]  # fmt: skip
COMPARED = ("iteration", "consumed_samples", "loss", "lr", "grad_norm", "loss_scale", "skipped", "nan")


@pytest.mark.slow
def test_library_checkpoint_resumes_in_train_py_bitwise(tmp_path):
    """4 iterations through the library API, dtgpt.save_checkpoint, then train.py resumes: its
    iterations 5-8 are bitwise those of one uninterrupted train.py run."""
    # Bitwise needs the same kernels: CPU reductions split their work by the thread count, and
    # train.py runs with OMP_NUM_THREADS=1 (tests/runs.py, as torchrun sets it).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _resume_library_checkpoint_in_train_py(tmp_path)
    finally:
        torch.set_num_threads(threads)
        dtgpt.shutdown(clean=False)


def _resume_library_checkpoint_in_train_py(tmp_path):
    args = TINY + RESUMED
    cfg = load_config(None, args)
    runtime = dtgpt.init_distributed(cfg)
    state = dtgpt.build_train_state(cfg, dtgpt.build_model(cfg, runtime, vocab_size=128))
    batches = dtgpt.build_train_iterator(cfg, state.model)
    library = [dtgpt.train_step(cfg, state, next(batches)) for _ in range(4)]
    gbs, skipped = cfg.training.global_batch_size, state.progress.skipped_iters
    assert state.progress.consumed_samples == 4 * gbs and state.lr_schedule.num_samples == (4 - skipped) * gbs
    assert 1 <= skipped < 4 and state.scaler.scale < 2.0**20  # the scaler has moved, the schedule too
    dtgpt.save_checkpoint(tmp_path / "ckpt", cfg, runtime, state)

    whole, resumed = read_metrics_of(tmp_path, {"whole": args, "resumed": args + [f"--checkpoint.load={tmp_path / 'ckpt'}"]})
    assert [r.loss for r in library] == [r["loss"] for r in whole[:4]]
    assert [as_logged(r.grad_norm) for r in library] == [r["grad_norm"] for r in whole[:4]]
    assert [r["iteration"] for r in resumed] == [5, 6, 7, 8]
    assert [{k: r[k] for k in COMPARED} for r in resumed] == [{k: r[k] for k in COMPARED} for r in whole[4:]]


def as_logged(value: float) -> float | None:
    return value if math.isfinite(value) else None  # the metrics file writes non-finite as null


def read_metrics_of(tmp_path, runs: dict[str, list[str]]) -> list[list[dict]]:
    """The metrics of train.py runs {name: args}, run in this order in one launch (tests/runs.py)."""
    finished = launch_commands([Command(name, tmp_path, args + [f"--logging.metrics_file={tmp_path / f'{name}.jsonl'}"]) for name, args in runs.items()])
    for name in runs:
        finished[name].checked()  # a run that failed fails the test with its log
    return [read_metrics(tmp_path / f"{name}.jsonl") for name in runs]


def test_bare_model_checkpoint_claims_no_training_state(tmp_path):
    """Saved from a model and the caller's own optimizer, a checkpoint holds weights, moments and
    RNG, and no LR schedule, loss scale or progress that dtgpt never ran; train.py's resume
    refuses it with one clear line instead of restarting a schedule at zero."""
    from dtgpt.checkpoint import CheckpointError, layout

    cfg = load_config(None, TINY)
    runtime = dtgpt.init_distributed(cfg)
    model = dtgpt.build_model(cfg, runtime, vocab_size=128)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    dtgpt.forward_backward(model, next(dtgpt.build_train_iterator(cfg, model)), dtgpt.num_microbatches(cfg, model.dims.dp))
    optimizer.step()
    directory = dtgpt.save_checkpoint(tmp_path / "bare", cfg, runtime, model, optimizer, iteration=3)
    sections = {key.split(".")[0] for key in layout.read_metadata(directory).state_dict_metadata}
    assert sections == {"model", "optimizer", "rng"}
    assert dtgpt.load_checkpoint(tmp_path / "bare", cfg, runtime, model, optimizer) == 3
    with pytest.raises(CheckpointError, match="holds no training state .* checkpoint.load_optimizer=false"):
        dtgpt.load_checkpoint(tmp_path / "bare", cfg, runtime, dtgpt.build_train_state(cfg, model))


@pytest.mark.slow
def test_a_model_of_another_layout_reads_by_its_own_mesh(tmp_path):
    """A runtime started at dp2 (tp1) builds a tp2 and a pp2 model from their own configs: each
    reads its batches by its own mesh (both tp ranks the same samples, the whole global batch)
    and trains and evaluates as one process does. The runtime itself, whose dp2 mesh would give
    the two tp ranks different samples, is refused as the reader."""
    from tests import library_layout_worker as worker

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", worker.__file__]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    results = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("result_*.json"))]
    cfg = dtgpt.make_config(model=worker.MODEL, data=worker.DATA, training=worker.TRAINING, eval=worker.EVAL)
    one = worker.run(cfg, dtgpt.init_distributed(cfg))
    for layout in worker.LAYOUTS:
        ranks = [r for r in results if r["layout"] == layout]
        assert len(ranks) == 2, proc.stdout[-2000:]
        for r in ranks:
            assert r["batches"] == one["batches"], (layout, r["rank"])  # the whole global batch, on each rank
            assert r["losses"] == pytest.approx(one["losses"], rel=1e-5), (layout, r["rank"])
            assert r["eval"] == pytest.approx(one["eval"], rel=1e-5), (layout, r["rank"])
    for rank in (0, 1):
        assert f"rank {rank} refused the runtime: build_train_iterator takes the model" in proc.stdout
