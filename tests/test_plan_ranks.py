"""The planner's ranks: their parameter counts against 8 real CPU ranks (the oracle), the
deduplicated builds, block recomputation on the real blocks, and the tokenizer's vocabulary."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dtgpt.config import load_config
from dtgpt.plan import plan_layout, tokenizer_vocab_size
from tests.plans import ENV, GPT3_175B, REPO, SMALL
from tests.test_data_tokenizer import write_hf_tokenizer

@pytest.mark.slow
def test_planner_counts_match_a_real_cpu_run(tmp_path):
    """The oracle: 8 ranks build the real model (tests/plan_real_counts.py) on CPU."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=8",
           str(REPO / "tests" / "plan_real_counts.py"), *SMALL, f"--data.data_cache_path={tmp_path}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    real = json.loads(proc.stdout.strip().splitlines()[-1])
    plan = plan_layout(load_config(None, SMALL), 8, dp_ranks=(0, 1))
    planned = {r.rank: (r.pp_rank, r.dp_rank, r.tp_rank, r.local_params) for r in plan.ranks}
    measured = {r["rank"]: (r["pp_rank"], r["dp_rank"], r["tp_rank"], r["local_params"]) for r in real}
    assert planned == measured
    # The layout is uneven on purpose: the check would miss nothing by comparing equal numbers.
    assert len({v[3] for v in measured.values()}) >= 4


def test_deduplicated_builds_equal_building_every_rank():
    cfg = load_config(None, SMALL + ["--parallel.pipeline_model_parallel_size=4", "--parallel.data_parallel_shard_size=1",
                                     "--parallel.pipeline_schedule=1F1B", "--parallel.virtual_pipeline_stages_per_rank=1",
                                     "--parallel.pipeline_layers_per_stage=[]", "--model.num_layers=8"])  # fmt: skip
    fast, full = plan_layout(cfg, 8), plan_layout(cfg, 8, all_ranks=True)
    assert fast.builds < full.builds == 8
    key = lambda p: [(r.rank, r.layer_ids, r.local_params, r.memory) for r in p.ranks]  # noqa: E731
    assert key(fast) == key(full)


def test_block_recomputation_follows_the_real_blocks():
    args = ["--training.recompute_granularity=full", "--training.recompute_method=block", "--training.recompute_num_layers=1"]
    plan = plan_layout(load_config(None, SMALL + args), 8)
    # 'block' recomputes the first block of each of the 4 stages ([2, 1, 1, 1] blocks): 4 of 5.
    by_pp = {r.pp_rank: r.recomputed_layers for r in plan.ranks}
    assert sum(by_pp.values()) == 4
    selective = plan_layout(load_config(None, SMALL + ["--training.recompute_granularity=selective"]), 8)
    plain = plan_layout(load_config(None, SMALL), 8)
    assert all(r.recomputed_layers == 0 for r in selective.ranks)
    for r, q in zip(selective.ranks, plain.ranks):
        assert 0 < r.memory["activations"] < q.memory["activations"]
    # A fused attention kernel keeps no scores: what selective recomputation drops.
    fused = plan_layout(load_config(None, SMALL), 8, fused_attention=True)
    assert [r.memory["activations"] for r in fused.ranks] == pytest.approx([r.memory["activations"] for r in selective.ranks])


def test_vocabulary_follows_the_tokenizer(tmp_path):
    vocab = tmp_path / "vocab.json"
    vocab.write_text(json.dumps({f"t{i}": i for i in range(300)}))
    gpt2 = load_config(GPT3_175B, [f"--data.vocab_file={vocab}"])
    assert tokenizer_vocab_size(gpt2) == (300, None)
    size, note = tokenizer_vocab_size(load_config(GPT3_175B, ["--data.vocab_file=missing.json"]))
    assert size == 50257 and "not found" in note
    assert tokenizer_vocab_size(load_config(None, SMALL))[0] == 257
    null = load_config(None, ["--data.mock_data=true", "--data.tokenizer_type=NullTokenizer", "--data.vocab_size=1000"])
    assert tokenizer_vocab_size(null)[0] == 1000
    hf = ["--data.mock_data=true", "--data.tokenizer_type=HuggingFaceTokenizer"]
    tokenizer_dir = write_hf_tokenizer(tmp_path / "hf")
    assert tokenizer_vocab_size(load_config(None, [*hf, f"--data.tokenizer_model={tokenizer_dir}"])) == (321, None)
    size, note = tokenizer_vocab_size(load_config(None, [*hf, "--data.tokenizer_model=missing", "--data.vocab_size=1000"]))
    assert size == 1000 and "data.tokenizer_model='missing': no such directory" in note


