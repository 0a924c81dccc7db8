"""Damaged Megatron-LM checkpoints and roots whose pointer leads nowhere: one line naming the file
or saying what the pointer holds, in convert_checkpoint.py and in a load (train.py prints a
CheckpointError as its one `error:` line). No megatron-core needed: the torch_dist checkpoint is
dtgpt's own conversion (tests/test_megatron_checkpoint.py checks it against megatron-core)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from dtgpt.checkpoint import CheckpointError, layout
from tests.test_checkpoint_convert import load_script
from tests.checkpoints import checkpointer, make_trainer, step


@pytest.fixture
def converted(tmp_path):
    """(Megatron torch_dist root at iteration 2, the dtgpt config it came from)."""
    root = tmp_path / "ckpt"
    t = make_trainer(f"--checkpoint.save={root}")
    step(t, 2)
    checkpointer(t).save(2)
    assert load_script().main(["to-megatron", str(root), str(tmp_path / "megatron")]) == 0
    return tmp_path / "megatron", layout.iteration_dir(root, 2) / layout.CONFIG


def one_error(capfd) -> str:
    lines = capfd.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def cut_in_half(path) -> int:
    os.truncate(path, path.stat().st_size // 2)
    return path.stat().st_size


@pytest.mark.parametrize("form", ["per_rank", "torch_dist"])
def test_a_truncated_megatron_shard_is_one_line_naming_the_file(converted, tmp_path, capfd, form):
    root, config = converted
    directory = layout.iteration_dir(root, 2)
    if form == "per_rank":  # Megatron's per-rank format: one torch.save archive per model-parallel rank
        shard = tmp_path / "per_rank" / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"
        shard.parent.mkdir(parents=True)
        torch.save({"model": {"embedding.word_embeddings.weight": torch.ones(128, 32)}, "iteration": 2}, shard)
        (tmp_path / "per_rank" / layout.POINTER).write_text("2\n")
        root, size = tmp_path / "per_rank", cut_in_half(shard)
        expected = (f"error: {shard}: cannot be read as a Megatron checkpoint file: it is truncated or corrupt ({size} bytes, "
                    "not a complete torch.save archive: File is not a zip file)")  # fmt: skip
    else:  # torch_dist: the largest data file (the embedding's)
        shard = max(directory.glob("*.distcp"), key=lambda p: p.stat().st_size)
        full = shard.stat().st_size
        size = cut_in_half(shard)
        expected = (f"error: Megatron checkpoint {directory}: data file {shard.name} is truncated ({size} bytes, the index "
                    f"needs {full}): the copy is incomplete or damaged")  # fmt: skip
    assert load_script().main(["from-megatron", str(root), str(tmp_path / "out"), "--config", str(config)]) == 2
    assert one_error(capfd) == expected
    with pytest.raises(CheckpointError) as e:
        checkpointer(make_trainer(f"--checkpoint.load={root}"))
    assert f"error: {e.value}" == expected


@pytest.mark.parametrize(
    "pointer, says",
    [
        (b"7\n", "latest_checkpointed_iteration.txt names iteration 7, but there is no iter_0000007"),
        (b"release\n", "latest_checkpointed_iteration.txt holds 'release', not an iteration number"),
        (b"\xff\xfe2\n", "latest_checkpointed_iteration.txt cannot be read ('utf-8' codec can't decode byte 0xff"),
        (None, "no latest_checkpointed_iteration.txt"),
    ],
)
def test_a_megatron_root_whose_pointer_leads_to_no_checkpoint_says_what_is_wrong(converted, tmp_path, capfd, pointer, says):
    """Megatron's iter_0000002 is there, but the pointer names a missing iteration, holds no number
    or is missing: the message says which (not "has no latest_checkpointed_iteration.txt" when it
    has one) and which directory to name instead."""
    root, config = converted
    if pointer is None:
        (root / layout.POINTER).unlink()
    else:
        (root / layout.POINTER).write_bytes(pointer)
    assert load_script().main(["from-megatron", str(root), str(tmp_path / "out"), "--config", str(config)]) == 2
    error = one_error(capfd)
    assert error.startswith(f"error: {root} holds Megatron checkpoints (iter_0000002) and {says}"), error
    assert error.endswith(f": name the directory to load itself, e.g. {layout.iteration_dir(root, 2)}"), error
    with pytest.raises(CheckpointError, match="holds Megatron checkpoints") as e:
        checkpointer(make_trainer(f"--checkpoint.load={root}"))
    assert f"error: {e.value}" == error
    assert load_script().main(["from-megatron", str(layout.iteration_dir(root, 2)), str(tmp_path / "out"), "--config", str(config)]) == 0


def test_a_pointer_that_names_no_number_is_named_as_such_when_nothing_loads(tmp_path):
    """dtgpt's own roots: the error says what the pointer holds, not that there is none."""
    (tmp_path / layout.POINTER).write_text("latest\n")
    with pytest.raises(CheckpointError) as e:
        layout.resolve(str(tmp_path), 0, fresh_ok=False)
    assert str(e.value).startswith(
        f"checkpoint.load={tmp_path} holds no complete checkpoint (latest_checkpointed_iteration.txt holds 'latest', "
        "not an iteration number; no completed iter_* directory)"
    )


@pytest.fixture(scope="module")
def per_rank_source(tmp_path_factory):
    """(Megatron per-rank files at tp 2 of a trained model, a config of that model whose
    vocabulary padding is Megatron's at tp 2), made once: each test damages a copy."""
    tmp = tmp_path_factory.mktemp("per_rank")
    t = make_trainer(f"--checkpoint.save={tmp / 'ckpt'}")
    step(t, 2)
    checkpointer(t).save(2)
    assert load_script().main(["to-megatron", str(tmp / "ckpt"), str(tmp / "per_rank"), "--format", "per-rank", "--tp", "2"]) == 0
    config = layout.iteration_dir(tmp / "ckpt", 2) / layout.CONFIG
    padded = tmp / "padded.toml"  # Megatron pads 128 rows to a multiple of 128 x tp
    padded.write_text(config.read_text().replace("make_vocab_size_divisible_by = 128", "make_vocab_size_divisible_by = 256"))
    return layout.iteration_dir(tmp / "per_rank", 2), padded


@pytest.fixture
def per_rank_tp2(per_rank_source, tmp_path):
    directory, config = per_rank_source
    shutil.copytree(directory, tmp_path / "per_rank" / directory.name)
    return tmp_path / "per_rank" / directory.name, config


def rank_file(directory, tp: int):
    return directory / f"mp_rank_{tp:02d}" / "model_optim_rng.pt"


def shorter_tensor(path) -> None:
    saved = torch.load(path, weights_only=False)
    key = next(k for k in saved["model"] if k.endswith("linear_qkv.weight"))
    saved["model"][key] = saved["model"][key][:-1]
    torch.save(saved, path)


def nan_in_layer_1(path) -> None:
    saved = torch.load(path, weights_only=False)
    saved["model"]["decoder.layers.1.mlp.linear_fc2.weight"][0, 0] = float("nan")
    torch.save(saved, path)


DAMAGE = {
    # rank 1's file is read while the tensors are written (DCP wraps what fails there)
    "truncated_rank_1": (lambda d: cut_in_half(rank_file(d, 1)), "mp_rank_01/model_optim_rng.pt: cannot be read as a Megatron "
                         "checkpoint file: it is truncated or corrupt ("),
    "a_shorter_tensor_in_rank_1": (lambda d: shorter_tensor(rank_file(d, 1)), "mp_rank_01/model_optim_rng.pt holds "
                                   "decoder.layers.0.self_attention.linear_qkv.weight of shape (47, 32) but tp rank 0's file (48, 32)"),
    "empty_rank_0": (lambda d: os.truncate(rank_file(d, 0), 0), "mp_rank_00/model_optim_rng.pt: cannot be read as a Megatron "
                     "checkpoint file: it is empty (0 bytes): the copy is incomplete"),
    "nan_in_rank_1": (lambda d: nan_in_layer_1(rank_file(d, 1)), "decoder.layers.mlp.linear_fc2.weight (layer 1) holds "
                      "non-finite values (NaN or inf): a damaged file?"),  # a load refuses it too (not written silently)
    "missing_rank_1": (lambda d: [p.unlink() for p in rank_file(d, 1).parent.iterdir()], "its args say tensor_model_parallel_size=2, "
                       "but its mp_rank_* directories hold 1 tp rank: a rank's directory is missing, or another checkpoint's was added"),
}  # fmt: skip


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_per_rank_file_is_one_line_and_leaves_no_partial_checkpoint(per_rank_tp2, tmp_path, capfd, damage):
    """Where each tp rank's file is read (rank 0's up front, rank 1's while DCP writes), the line
    names the file and what is wrong, and the new directory keeps no half-written iteration."""
    directory, config = per_rank_tp2
    do, says = DAMAGE[damage]
    do(directory)
    capfd.readouterr()
    assert load_script().main(["from-megatron", str(directory), str(tmp_path / "out"), "--config", str(config)]) == 2
    assert says in one_error(capfd)
    assert layout.list_iterations(tmp_path / "out") == []


def test_per_rank_files_in_torchs_legacy_format_are_read(per_rank_tp2, tmp_path):
    """Files torch.save wrote before its zip format cannot be memory-mapped: they are read whole."""
    directory, config = per_rank_tp2
    for tp in (0, 1):
        torch.save(torch.load(rank_file(directory, tp), weights_only=False), rank_file(directory, tp), _use_new_zipfile_serialization=False)
    assert load_script().main(["from-megatron", str(directory), str(tmp_path / "out"), "--config", str(config)]) == 0
