"""Save, stop, resume under train.py / torchrun: the resumed run continues the uninterrupted one.

Same mesh: per-iteration losses equal exactly (dropout on, so the RNG state must come back too).
Another mesh: the model and optimizer are resharded and the losses match to fp32 rounding.
Each uninterrupted run saves at iteration SAVED (3: past the LR warmup, into the decay) and goes
on to ITERS (6); resuming from iteration SAVED (checkpoint.load_iteration) must reproduce
iterations SAVED+1..ITERS. A global batch of BATCH (4) samples: what a checkpoint holds does not
grow with the micro-batch count, and every pipeline still runs a micro-batch per stage or more.

The runs share launches (tests/runs.py launch_commands): one per rank count, each resume after
the run it resumes, 4 ranks first (their checkpoints are resumed on 1 and 2 ranks), then 1, then
2; each run still starts its own process group and reads its checkpoint from disk.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from dtgpt.checkpoint import layout, stored
from dtgpt.checkpoint.export import read_sections
from tests.runs import REPO, Command, launch_commands, read_metrics, selected_cases

pytestmark = pytest.mark.slow  # train.py and torchrun runs

ITERS, SAVED = 6, 3
BATCH = 4  # samples per iteration
BASE = [
    "--model.num_layers=2", "--model.hidden_size=32", "--model.num_attention_heads=4", "--model.seq_length=32",
    "--model.make_vocab_size_divisible_by=64", "--training.micro_batch_size=2", f"--training.global_batch_size={BATCH}",
    f"--training.train_iters={ITERS}", "--optimizer.lr=3e-3", "--optimizer.lr_warmup_iters=2",
    "--optimizer.lr_decay_style=cosine", "--data.mock_data=true", "--data.tokenizer_type=NullTokenizer",
    "--data.vocab_size=128", "--data.num_workers=0", "--eval.eval_iters=0", f"--logging.log_interval={SAVED}",
]  # fmt: skip
DROPOUT = ["--model.hidden_dropout=0.1", "--model.attention_dropout=0.1"]
NO_DROPOUT = ["--model.hidden_dropout=0.0", "--model.attention_dropout=0.0"]
# Megatron's decoupled LR (the embedding and output layer in an AdamW group of their own): the
# bitwise resumes below run with it, so its group and LR come back exactly
DECOUPLED = ["--decoupled-lr=1e-2", "--decoupled-min-lr=1e-3"]
DP2_TP2 = ["--parallel.tensor_model_parallel_size=2"]
PP2 = ["--parallel.pipeline_model_parallel_size=2", "--parallel.pipeline_schedule=1F1B"]
# Megatron's --optimizer muon, its Newton-Schulz iteration in fp32: its momentum (sharded as each
# matrix) beside AdamW's moments, saved by pp2 x cp2 and read by one process (dtgpt/muon.py)
MUON = ["--optimizer=muon", "--muon-fp32-matmul-prec=high"]
# the first stage holds the embeddings alone: no bias or norm, so its optimizer has no such group
EMBEDDING_ALONE = "--pipeline-model-parallel-layout=E|t*2L"


SECONDS = 180  # per run: 6 tiny iterations on up to 4 ranks, 2 loaded cores
LAUNCH_ORDER = (4, 1, 2)  # rank counts: a 4-rank checkpoint is resumed on 1 and 2 ranks


def train(directory, key: str, args: list[str], nproc: int = 1) -> Command:
    """A run of BASE + args in `directory`, its metrics in KEY.jsonl there."""
    return Command(key, directory, BASE + args + [f"--logging.metrics_file={directory / f'{key}.jsonl'}"], nproc, SECONDS)


def uninterrupted(directory, key: str, args: list[str], nproc: int) -> Command:
    """ITERS iterations, saving at SAVED and ITERS into KEY_ckpt."""
    return train(directory, key, args + [f"--checkpoint.save={directory / f'{key}_ckpt'}", f"--checkpoint.save_interval={SAVED}"], nproc)


def resume(directory, key: str, root, args: list[str], nproc: int, save=None) -> Command:
    """From iteration SAVED of the checkpoints under root (saved by an earlier run of the batch)."""
    extra = [f"--checkpoint.load={root}", f"--checkpoint.load_iteration={SAVED}"]
    if save:
        extra.append(f"--checkpoint.save={save}")
    return train(directory, key, args + extra, nproc)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict:
    """Every run the selected tests read, launched together: {key: (Finished, its directory)}."""

    def selected(test) -> list[str]:
        return selected_cases(request, test)

    directory = tmp_path_factory.mktemp
    commands: list[Command] = []
    if selected(test_resume_one_process_is_bitwise_identical):
        d = directory("one_process")
        args = DROPOUT + DECOUPLED
        commands += [uninterrupted(d, "bitwise", args, 1), resume(d, "bitwise_resumed", d / "bitwise_ckpt", args, 1)]
    if selected(test_evaluation_after_a_resume_continues_the_validation_stream):
        d = directory("evaluation")
        commands += [train(d, "eval", EVAL + [f"--checkpoint.save={d / 'eval_ckpt'}", f"--checkpoint.save_interval={SAVED}"]),
                     train(d, "eval_resumed", EVAL + [f"--checkpoint.load={d / 'eval_ckpt'}", f"--checkpoint.load_iteration={SAVED}"])]  # fmt: skip
    if selected(test_resume_two_ranks_bitwise_and_async_equals_sync):
        d = directory("two_ranks")
        args = DROPOUT + DECOUPLED + PP2 + [EMBEDDING_ALONE]
        commands += [uninterrupted(d, "pp2", args + ["--checkpoint.async_save=true"], 2),
                     resume(d, "pp2_resumed", d / "pp2_ckpt", args, 2, save=d / "pp2_resumed_ckpt")]  # fmt: skip
    meshes = selected(test_dp2_tp2_checkpoint_resumes_on_other_meshes)
    one = selected(test_dp2_tp2_checkpoint_resumes_in_one_process)
    if meshes or one or any(selected(t) for t in (test_every_stored_key_is_documented_in_stored_py, test_generate_from_dp2_tp2_checkpoint)):
        d = directory("dp2tp2")
        commands.append(uninterrupted(d, "dp2tp2", NO_DROPOUT + DP2_TP2, 4))
        for mesh in meshes:
            nproc, args = SLOW_MESHES[mesh]
            commands.append(resume(directory(mesh), f"dp2tp2_{mesh}", d / "dp2tp2_ckpt", NO_DROPOUT + args, nproc))
        if one:
            commands.append(resume(directory("dp2tp2_one"), "dp2tp2_one", d / "dp2tp2_ckpt", NO_DROPOUT, 1))
    if selected(test_one_process_checkpoint_resumes_on_dualpipev):
        d = directory("dualpipev")
        commands += [uninterrupted(d, "four_layers", FOUR_LAYERS, 1), resume(d, "dualpipev", d / "four_layers_ckpt", FOUR_LAYERS + DUALPIPEV, 2)]
    if selected(test_pp2_cp2_checkpoint_resumes_in_one_process):
        d = directory("pp2cp2")
        commands += [uninterrupted(d, "pp2cp2", NO_DROPOUT + MUON + PP2 + ["--parallel.context_parallel_size=2"], 4),
                     resume(d, "pp2cp2_one", d / "pp2cp2_ckpt", NO_DROPOUT + MUON, 1)]  # fmt: skip
    finished = launch_commands(sorted(commands, key=lambda c: LAUNCH_ORDER.index(c.nproc)))
    return {c.key: (finished[c.key], c.directory) for c in commands}


def losses_of(runs: dict, key: str) -> tuple[dict[int, float], str]:
    """(losses by iteration, the run's output) of a run that finished; one that failed fails the test."""
    finished, directory = runs[key]
    output = finished.checked()
    return {r["iteration"]: r["loss"] for r in read_metrics(directory / f"{key}.jsonl")}, output


def uninterrupted_run(runs: dict, key: str):
    """An uninterrupted run's (losses, checkpoint root), checked: ITERS iterations, saved at SAVED and ITERS."""
    losses, _ = losses_of(runs, key)
    root = runs[key][1] / f"{key}_ckpt"
    assert sorted(losses) == list(range(1, ITERS + 1))
    assert layout.read_pointer(root) == ITERS and layout.list_iterations(root) == [SAVED, ITERS]
    return losses, root


def resumed_run(runs: dict, key: str):
    losses, out = losses_of(runs, key)
    assert sorted(losses) == list(range(SAVED + 1, ITERS + 1)), "the resumed run must start after iteration SAVED"
    return losses, out


def assert_close(reference: dict, resumed: dict, rel: float) -> None:
    for it, loss in resumed.items():
        assert abs(loss - reference[it]) <= rel * abs(reference[it]), (it, loss, reference[it])


def assert_same_tensors(a_dir, b_dir) -> None:
    a, b = read_sections(a_dir), read_sections(b_dir)
    assert a.keys() == b.keys()
    for section in a:
        assert a[section].keys() == b[section].keys(), section
        for key, value in a[section].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, b[section][key]), f"{section}.{key}"
            else:
                assert value == b[section][key], f"{section}.{key}"


def test_resume_one_process_is_bitwise_identical(runs):
    reference, _ = uninterrupted_run(runs, "bitwise")
    resumed, out = resumed_run(runs, "bitwise_resumed")
    assert resumed == {it: reference[it] for it in range(SAVED + 1, ITERS + 1)}
    assert "loaded checkpoint" in out and f"iteration {SAVED}, consumed samples {SAVED * BATCH}" in out


def evaluation_lines(output: str) -> dict[str, str]:
    """The printed validation/test results, by where they were taken ("iteration 6", "iteration 6 on test set")."""
    found = re.findall(r" validation loss at (iteration \d+(?: on test set)?) \| (lm loss value: \S+)", output)
    return dict(found)


EVAL = DROPOUT + [f"--eval.eval_interval={SAVED}", "--eval.eval_iters=2"]


def test_evaluation_after_a_resume_continues_the_validation_stream(runs):
    """ITERS iterations evaluating every SAVED vs SAVED + save + resume to ITERS: the resumed run's
    validation at iteration ITERS reads the batches the uninterrupted one read there
    (consumed_valid_samples is in the checkpoint, as Megatron's args.consumed_valid_samples), and
    the test split starts at 0."""
    _, full = losses_of(runs, "eval")
    _, resumed = losses_of(runs, "eval_resumed")
    root = runs["eval"][1] / "eval_ckpt"
    reference, after = evaluation_lines(full), evaluation_lines(resumed)
    saved, last, test = f"iteration {SAVED}", f"iteration {ITERS}", f"iteration {ITERS} on test set"
    assert set(reference) == {saved, last, test}
    assert reference[saved] != reference[last]
    assert after == {k: reference[k] for k in (last, test)}
    progress = read_sections(layout.iteration_dir(root, SAVED), ("train_state",))["train_state"]
    assert int(progress["consumed_valid_samples"]) == 2 * BATCH  # eval_iters global batches


def test_resume_two_ranks_bitwise_and_async_equals_sync(runs):
    """pp=2 (1F1B), the first stage holding the embeddings alone (its AdamW has no group for biases
    and norms). The uninterrupted run saves asynchronously, the resumed one synchronously:
    both final checkpoints hold the same state, so their tensors are equal. The last stage's
    copy of the tied weight is not stored; it is read back from the embedding."""
    reference, root = uninterrupted_run(runs, "pp2")
    keys = layout.read_metadata(layout.iteration_dir(root, SAVED)).state_dict_metadata
    assert not any("output.weight" in k for k in keys) and "optimizer.state.embedding.word.weight.exp_avg" in keys
    assert {"rng.pp_0.tp_0.cpu", "rng.pp_1.tp_0.cpu"} <= set(keys)
    resumed_root = runs["pp2"][1] / "pp2_resumed_ckpt"
    resumed, _ = resumed_run(runs, "pp2_resumed")
    assert resumed == {it: reference[it] for it in range(SAVED + 1, ITERS + 1)}
    assert_same_tensors(layout.iteration_dir(root, ITERS), layout.iteration_dir(resumed_root, ITERS))


@pytest.fixture
def dp2_tp2(runs):
    """An uninterrupted dp2 x tp2 run (4 ranks): (losses, its checkpoints' root)."""
    return uninterrupted_run(runs, "dp2tp2")


def test_dp2_tp2_checkpoint_resumes_in_one_process(dp2_tp2, runs):
    reference, _ = dp2_tp2
    resumed, out = resumed_run(runs, "dp2tp2_one")
    assert_close(reference, resumed, 1e-5)
    assert "re-derived" in out  # other mesh: the saved per-rank RNG states do not apply


def documented_key_patterns() -> list[re.Pattern]:
    """The key patterns of dtgpt/checkpoint/stored.py's module doc: its block of lines indented
    by four spaces, each a pattern (or several: "a.* b.*", "x.cpu / .cuda") and a description."""
    patterns = []
    for line in stored.__doc__.splitlines():
        if not line.startswith("    ") or line.startswith("     "):
            continue
        names = re.split(r"\s{2,}", line.strip())[0]
        alternatives = names.split(" / ")
        base = alternatives[0].rsplit(".", 1)[0]
        for name in [alternatives[0], *(base + a for a in alternatives[1:])] if len(alternatives) > 1 else names.split():
            text = re.escape(name).replace(r"\*", ".+").replace(re.escape("<fqn>"), ".+")
            patterns.append(re.compile(re.sub(r"<[a-z]+>", "[^.]+", text) + "$"))
    return patterns


def test_every_stored_key_is_documented_in_stored_py(dp2_tp2):
    """dtgpt/checkpoint/stored.py lists what a checkpoint holds: every key of a dp2 x tp2 one
    (the RNG states under their (pp, tp) coordinate) matches one of its patterns."""
    _, root = dp2_tp2
    keys = layout.read_metadata(layout.iteration_dir(root, SAVED)).state_dict_metadata
    assert {"rng.pp_0.tp_0.cpu", "rng.pp_0.tp_1.cpu"} <= set(keys)
    patterns = documented_key_patterns()
    assert [k for k in keys if not any(p.match(k) for p in patterns)] == []


def test_generate_from_dp2_tp2_checkpoint(dp2_tp2):
    _, root = dp2_tp2
    cmd = [sys.executable, str(REPO / "scripts/generate.py"), str(root), "--prompt", "1 2 3 4",
           "--max-new-tokens", "6", "--temperature", "0.8", "--top-k", "10"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    ids = proc.stdout.split()
    assert ids[:4] == ["1", "2", "3", "4"] and len(ids) == 10
    assert all(0 <= int(i) < 128 for i in ids)
    assert f"iter_{ITERS:07d}" in proc.stderr


SLOW_MESHES = {
    "pp2_1f1b": (2, ["--parallel.pipeline_model_parallel_size=2", "--parallel.pipeline_schedule=1F1B"]),
    "tp4": (4, ["--parallel.tensor_model_parallel_size=4"]),
    "dp4_mbs1": (4, ["--training.micro_batch_size=1"]),  # a batch of 4 over 4 ranks
    "hsdp2x2_mbs1": (4, ["--parallel.data_parallel_replicate_size=2", "--training.micro_batch_size=1"]),
    "cp2_tp2": (4, ["--parallel.context_parallel_size=2", "--parallel.tensor_model_parallel_size=2"]),  # saved at cp 1
}
# 4 stages: a micro-batch of 1 gives the 4 micro-batches DualPipeV needs (the saved run's 2 are of 2)
DUALPIPEV = ["--parallel.pipeline_model_parallel_size=2", "--parallel.pipeline_schedule=DualPipeV",
             "--parallel.virtual_pipeline_stages_per_rank=2", "--training.micro_batch_size=1"]  # fmt: skip


@pytest.mark.parametrize("mesh", sorted(SLOW_MESHES))
def test_dp2_tp2_checkpoint_resumes_on_other_meshes(dp2_tp2, runs, mesh):
    reference, _ = dp2_tp2
    resumed, _ = resumed_run(runs, f"dp2tp2_{mesh}")
    assert_close(reference, resumed, 1e-5)


FOUR_LAYERS = NO_DROPOUT + ["--model.num_layers=4"]


def test_one_process_checkpoint_resumes_on_dualpipev(runs):
    """V-shaped schedule: rank 0 holds the first and the last stage, so both copies of the tied
    weight live on one rank and are filled from one stored tensor."""
    reference, _ = uninterrupted_run(runs, "four_layers")
    resumed, _ = resumed_run(runs, "dualpipev")
    assert_close(reference, resumed, 1e-5)


def test_pp2_cp2_checkpoint_resumes_in_one_process(runs):
    """Saved by two stages (tied copy left out) with FSDP over the two cp ranks, read by one model
    where the head is the embedding and the sequence is whole; trained with Muon, whose momentum
    (FSDP shards) is resharded beside AdamW's moments."""
    reference, _ = uninterrupted_run(runs, "pp2cp2")
    resumed, _ = resumed_run(runs, "pp2cp2_one")
    assert_close(reference, resumed, 1e-5)
