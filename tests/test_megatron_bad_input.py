"""Damaged Megatron-LM checkpoints and roots whose pointer leads nowhere: one line naming the file
or saying what the pointer holds, in convert_checkpoint.py and in a load (train.py prints a
CheckpointError as its one `error:` line). No megatron-core needed: the torch_dist checkpoint is
dtgpt's own conversion (tests/test_megatron_checkpoint.py checks it against megatron-core)."""

from __future__ import annotations

import os

import pytest
import torch

from dtgpt.checkpoint import CheckpointError, layout
from tests.test_checkpoint_convert import load_script
from tests.test_checkpoint_unit import checkpointer, make_trainer, step


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
