"""megatron-core's distributed optimizer saved by tp 2 x pp 2 ranks (the adam_tp2pp2 launch,
conftest.py), read by dtgpt tensor by tensor against megatron-core's own model-space gathering:
its dp_reshardable buckets and each per-rank file's distrib_optim.pt, without and with virtual
pipeline stages (interleaved 1F1B: a grad buffer per model chunk). The runs that train on from
these saves are test_megatron_checkpoint_resume.py's ADAM_LAYOUTS rows."""

from __future__ import annotations

import shutil

import pytest
import torch

from dtgpt.checkpoint import layout
from dtgpt.checkpoint.megatron.distrib_optim import candidate_cuts
from dtgpt.checkpoint.megatron.formats import PER_RANK_FILE, load_pickle
from dtgpt.checkpoint.megatron.keys import full_model_shapes
from dtgpt.checkpoint.megatron.per_rank_optim import parameters
from dtgpt.checkpoint.megatron.reader import MegatronReader
from tests.megatron_gpt import ITERATION, PARALLEL_ADAM, VIRTUAL_ADAM
from tests.megatron_checkpoints import ROWS_TP2, model_cfg
from tests.test_megatron_family import model_cfg as family_cfg

pytestmark = pytest.mark.slow

TP2PP2_OPTIMIZER_FILES = ("dp_reshardable", "distrib_optim", "distrib_optim_buckets")
"""adam_tp2pp2's saves of each model besides megatron-core's model-space one (tests/megatron_adam.py
run_adam_parallel): torch_dist's dp_reshardable buckets, and the per-rank format with each
rank's distrib_optim.pt of one bucket and of PARALLEL_BUCKET_SIZE buckets."""


def assert_reads_as_gathered(root, shapes: dict) -> dict[str, MegatronReader]:
    """Every optimizer slot of every tensor, read from each of root's TP2PP2_OPTIMIZER_FILES,
    equals megatron-core's model-space save under root, bit for bit; the readers, by source."""
    readers = {source: MegatronReader(layout.iteration_dir(root / source, ITERATION)) for source in TP2PP2_OPTIMIZER_FILES}
    gathered = MegatronReader(layout.iteration_dir(root, ITERATION))
    for reader in (*readers.values(), gathered):
        reader.check(shapes, list(shapes))
    assert readers["dp_reshardable"].bucket_layout()[1] == "local" and gathered.bucket_layout()[0] is None
    for source in ("distrib_optim", "distrib_optim_buckets"):
        assert readers[source].per_rank_optimizer_problem() == "" and readers[source].optimizer_common() == {"common_step": 1.0}
    for name, shape in shapes.items():
        for slot in ("param", "exp_avg", "exp_avg_sq"):
            expected = gathered.tensor(name, shape, slot)
            for source, reader in readers.items():
                assert torch.equal(reader.tensor(name, shape, slot), expected), (source, name, slot)
    return readers


def assert_cuts_as_made(reader: MegatronReader, made: dict, chunks: tuple[str, ...]) -> None:
    """Each per-rank file's bucket cuts, recomputed from the file alone (its args, each chunk's
    parameters), are the ones megatron-core's DDP made (made: bucket_lengths.pt)."""
    for rank_dir in sorted(reader.directory.glob("mp_rank_*")):
        saved = load_pickle(rank_dir / PER_RANK_FILE)
        for c, chunk in enumerate(chunks):
            assert candidate_cuts(parameters(saved[chunk]), saved["args"], 2, int(rank_dir.name[-3:]), c) == [made[rank_dir.name][c]]


@pytest.mark.parametrize("arch", [arch for arch, _ in PARALLEL_ADAM])
def test_optimizer_state_saved_at_tp2_pp2_reads_as_megatron_gathers_it(adam_tp2pp2, arch):
    """Saved by tp 2 x pp 2 ranks, each model-parallel rank's state (its stage, its tp shards:
    vocabulary rows, QKV rows, SwiGLU's [gate; up] rows, row-parallel columns) reads, tensor by
    tensor, bit for bit as megatron-core's model-space save of the same state, which gathers the
    shards itself: from torch_dist's dp_reshardable buckets, and from each per-rank file's
    distrib_optim.pt (--ckpt-format torch), whose bucket cuts dtgpt recomputes from the file
    alone as megatron-core's DDP made them (several buckets on the first stage, one on the last;
    the tied GPT's embedding and its last-stage copy each in a bucket of its own)."""
    cfg = model_cfg(make_vocab_size_divisible_by=32) if arch == "gpt" else family_cfg(arch)
    readers = assert_reads_as_gathered(adam_tp2pp2 / arch, full_model_shapes(cfg, ROWS_TP2))
    made = torch.load(adam_tp2pp2 / arch / "bucket_lengths.pt", weights_only=True)
    assert_cuts_as_made(readers["distrib_optim_buckets"], made, ("model",))
    assert len(made["mp_rank_00_000"][0]) > 1


def test_optimizer_state_saved_with_virtual_stages_reads_as_megatron_gathers_it(adam_tp2pp2):
    """Saved at tp 2 x pp 2 with 2 virtual stages per pp rank (a layer each; chunk c of pp rank r
    holds virtual stage c x pp + r), each rank's two grad buffers (gbuf_idx 0 and 1 in
    dp_reshardable, gbufs 0 and 1 of its distrib_optim.pt) read bit for bit as megatron-core's
    model-space save: the embedding in chunk 0 of pp rank 0, the final norm, the tied head's copy
    in a bucket of its own in chunk 1 of pp rank 1, several buckets in the first chunk of pp
    rank 0 alone (Megatron-LM buckets no later chunk)."""
    name, layers, vp = VIRTUAL_ADAM
    cfg = model_cfg(make_vocab_size_divisible_by=32, num_layers=layers)
    readers = assert_reads_as_gathered(adam_tp2pp2 / name, full_model_shapes(cfg, ROWS_TP2))
    made = torch.load(adam_tp2pp2 / name / "bucket_lengths.pt", weights_only=True)
    assert_cuts_as_made(readers["distrib_optim_buckets"], made, tuple(f"model{c}" for c in range(vp)))
    assert len(made["mp_rank_00_000"][0]) > 1 and [len(lengths) for lengths in made["mp_rank_00_001"]] == [1, 2]


def test_unmapped_distrib_optim_at_pp2_is_one_line_naming_the_file(adam_tp2pp2, tmp_path):
    """At tp 2 x pp 2: master weights that differ from the weights (one element of the first
    stage's buffer), a last stage's distrib_optim.pt of two grad buffers for its one model chunk
    (MoE experts, mixed dtypes), and, with virtual stages, one buffer for two chunks, are found
    before any region is read, and the file named."""
    directory = layout.iteration_dir(shutil.copytree(adam_tp2pp2 / "gpt" / "distrib_optim", tmp_path / "distrib_optim"), ITERATION)
    first, last = directory / "mp_rank_00_000", directory / "mp_rank_00_001"
    state = load_pickle(first / "distrib_optim.pt")
    state[0][(torch.float32, torch.float32)]["param"][0] += 1.0  # the first element of the last parameter in module order
    torch.save(state, first / "distrib_optim.pt")
    why = MegatronReader(directory).per_rank_optimizer_problem()
    assert why.startswith(f"{first / PER_RANK_FILE} has a distrib_optim.pt whose grad buffer 0 holds ") and why.endswith(
        "(its master weights differ from the weights)"), why  # fmt: skip
    state = load_pickle(last / "distrib_optim.pt")
    torch.save({**state, 1: state[0]}, last / "distrib_optim.pt")
    why = MegatronReader(directory).per_rank_optimizer_problem()
    assert why.startswith(f"{last / PER_RANK_FILE} has a distrib_optim.pt of 2 grad buffers for 1 model chunk, "), why
    name = VIRTUAL_ADAM[0]
    directory = layout.iteration_dir(shutil.copytree(adam_tp2pp2 / name / "distrib_optim", tmp_path / name), ITERATION)
    last = directory / "mp_rank_00_001"
    state = load_pickle(last / "distrib_optim.pt")
    del state[1]
    torch.save(state, last / "distrib_optim.pt")
    why = MegatronReader(directory).per_rank_optimizer_problem()
    assert why.startswith(f"{last / PER_RANK_FILE} has a distrib_optim.pt of 1 grad buffers for 2 model chunks, "), why
