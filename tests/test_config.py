"""Config: TOML loading, overrides, validation errors that name key, value and rule."""

import subprocess
import sys
from pathlib import Path

import pytest

from dtgpt.config import (
    MULTI_STAGE_SCHEDULES,
    PIPELINE_SCHEDULES,
    Config,
    ConfigError,
    config_from_dict,
    data_parallel_size,
    load_config,
    load_toml,
    mesh_shape,
    num_microbatches,
    padded_vocabulary,
    split_overrides,
    to_toml,
    validate,
    validate_mesh,
)

REPO = Path(__file__).resolve().parent.parent
CONFIGS = sorted((REPO / "configs").glob("*.toml"))


NO_DROPOUT = {"model__hidden_dropout": 0.0, "model__attention_dropout": 0.0}


def base(**overrides) -> Config:
    cfg = Config()
    cfg.data.mock_data = True
    for dotted, value in overrides.items():
        section, key = dotted.split("__")
        setattr(getattr(cfg, section), key, value)
    return cfg


def error_of(cfg: Config, world_size=None) -> str:
    with pytest.raises(ConfigError) as exc:
        validate(cfg, world_size)
    return str(exc.value)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_are_valid_and_round_trip(path):
    cfg = load_config(path)
    again = config_from_dict(__import__("tomllib").loads(to_toml(cfg)))
    assert again == cfg


def test_gpt3_175b_carries_megatron_values():
    cfg = load_config(REPO / "configs/gpt3_175b.toml")
    m, t, o, p = cfg.model, cfg.training, cfg.optimizer, cfg.parallel
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, m.max_position_embeddings) == (96, 12288, 96, 2048, 2048)
    assert (t.micro_batch_size, t.global_batch_size, t.rampup_batch_size, t.train_iters) == (1, 1536, [16, 16, 5859375], 500000)
    assert (o.weight_decay, o.adam_beta1, o.adam_beta2, m.init_method_std, o.clip_grad) == (0.1, 0.9, 0.95, 0.006, 1.0)
    assert t.fp16 and not t.bf16
    assert (o.lr, o.lr_decay_style, o.min_lr, o.lr_warmup_fraction, o.lr_decay_iters) == (6e-5, "cosine", 6e-6, 0.001, 430000)
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size) == (8, 16)
    assert cfg.data.split == "949,50,1" and cfg.data.tokenizer_type == "GPT2BPETokenizer"
    assert (cfg.logging.log_interval, cfg.checkpoint.save_interval, cfg.eval.eval_interval, cfg.eval.eval_iters) == (100, 10000, 1000, 10)
    assert m.make_vocab_size_divisible_by == 1024


def test_overrides_both_spellings_and_types(tmp_path):
    cfg = load_config(
        None,
        [
            "--training.train_iters", "20",
            "--optimizer.lr=1e-3",
            "--training.rampup_batch_size=[4, 4, 100]",
            "--data.data_path", "0.3 prefA 0.7 prefB",
            "--optimizer.lr_warmup_fraction=0.01",
            "--model.untie_embeddings_and_output_weights=yes",
        ],
    )  # fmt: skip
    assert cfg.training.train_iters == 20 and cfg.optimizer.lr == 1e-3
    assert cfg.training.rampup_batch_size == [4, 4, 100]
    assert cfg.data.data_path == ["0.3", "prefA", "0.7", "prefB"]
    assert cfg.optimizer.lr_warmup_fraction == 0.01
    assert cfg.model.untie_embeddings_and_output_weights is True


def test_override_none_for_optional():
    cfg = load_config(None, ["--data.mock_data=true", "--optimizer.lr_decay_iters=none"])
    assert cfg.optimizer.lr_decay_iters is None


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--modle.hidden_size=3"], "unknown section in --modle.hidden_size; did you mean 'model'?"),
        (["--model.hiden_size=3"], "did you mean 'hidden_size'?"),
        (["--model.hidden_size=abc"], "model.hidden_size='abc' must be an int"),
        (["--training.fp16=maybe"], "training.fp16='maybe' must be a bool"),
        (["--training.rampup_batch_size=[1,"], "is not a valid list"),
        (["--training.train_iters"], "has no value"),
        (["stray"], "unexpected argument 'stray'"),
    ],
)
def test_override_errors(args, expected):
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["--data.mock_data=true"] + args)
    assert expected in str(exc.value)


def test_toml_errors(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nnum_layers = = 3\n")
    with pytest.raises(ConfigError, match=r"malformed TOML.*line 2"):
        load_toml(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_toml(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match=r"unknown key model.num_layer; did you mean 'num_layers'"):
        config_from_dict({"model": {"num_layer": 2}}, "x.toml")
    with pytest.raises(ConfigError, match=r"unknown section \[trainig\]; did you mean 'training'"):
        config_from_dict({"trainig": {}}, "x.toml")
    with pytest.raises(ConfigError, match=r"model.num_layers='2' must be an int"):
        config_from_dict({"model": {"num_layers": "2"}})
    with pytest.raises(ConfigError, match=r"training.fp16=1 must be a bool"):
        config_from_dict({"training": {"fp16": 1}})
    with pytest.raises(ConfigError, match=r"training.rampup_batch_size\[1\]=1.5 must be an int"):
        config_from_dict({"training": {"rampup_batch_size": [1, 1.5, 3]}})


@pytest.mark.parametrize(
    "overrides,world,expected",
    [
        ({"parallel__tensor_model_parallel_size": 3, "model__num_attention_heads": 64, "model__hidden_size": 512},
         None, "parallel.tensor_model_parallel_size=3 must divide model.num_attention_heads=64"),
        ({"model__num_layers": 5, "parallel__pipeline_model_parallel_size": 2},
         None, "model.num_layers=5 must be divisible by the number of pipeline stages"),
        ({"training__fp16": True, "training__bf16": True}, None, "cannot both be set"),
        ({"training__fp32_residual_connection": True}, None, "training.fp32_residual_connection=true needs training.fp16 or training.bf16"),
        ({"optimizer__lr_warmup_iters": 200, "training__train_iters": 100}, None, "warmup < decay"),
        ({"optimizer__lr_warmup_fraction": 1.0}, None, "lr_warmup_fraction=1.0 must be in [0, 1)"),
        ({"training__global_batch_size": 10, "training__micro_batch_size": 4}, None,
         "training.micro_batch_size=4 must divide training.global_batch_size=10"),
        ({"training__global_batch_size": 6, "training__micro_batch_size": 1}, 4,
         "training.global_batch_size=6 must be divisible by micro_batch_size=1 * data-parallel size 4"),
        ({"parallel__pipeline_schedule": "Interleaved1F1B", "parallel__pipeline_model_parallel_size": 2}, None,
         "set parallel.virtual_pipeline_stages_per_rank >= 2"),
        ({"parallel__data_parallel_shard_size": 3}, 4, "world size 4 != pipeline_model_parallel_size=1"),
        ({"parallel__tensor_model_parallel_size": 3, "model__num_attention_heads": 3, "model__hidden_size": 48,
          "model__ffn_hidden_size": 100}, None, "must divide the MLP width model.ffn_hidden_size=100"),
        ({"data__mock_data": False}, None, "no training data"),
        ({"parallel__pipeline_schedule": "Zig"}, None, "parallel.pipeline_schedule='Zig' is not one of: 'GPipe', '1F1B'"),
        ({"training__rampup_batch_size": [3, 2, 100], "training__global_batch_size": 8}, None,
         "must be a non-negative multiple of the increment"),
        ({"parallel__pipeline_model_parallel_size": 2, "parallel__pipeline_schedule": "DualPipeV",
          "parallel__virtual_pipeline_stages_per_rank": 2, "training__global_batch_size": 2, "model__num_layers": 4}, 2,
         "parallel.pipeline_schedule='DualPipeV' needs at least as many micro-batches per iteration as pipeline stages "
         "(pipeline_model_parallel_size=2 * virtual_pipeline_stages_per_rank=2 = 4), but training.global_batch_size=2 "
         "gives 2 micro-batches (2 / (micro_batch_size=1 * data-parallel size 1))"),
        # The ramp-up's first batch is the smallest of the run: DualPipeV refused before any process group.
        ({"parallel__pipeline_model_parallel_size": 2, "parallel__pipeline_schedule": "DualPipeV",
          "parallel__virtual_pipeline_stages_per_rank": 2, "model__num_layers": 4, "training__global_batch_size": 16,
          "training__rampup_batch_size": [4, 4, 32], "parallel__data_parallel_shard_size": 2}, 4,
         "but training.rampup_batch_size start=4 gives 2 micro-batches (4 / (micro_batch_size=1 * data-parallel size 2)); "
         "use a first batch of >= 8"),
        ({"parallel__pipeline_model_parallel_size": 2, "parallel__pipeline_schedule": "DualPipeV",
          "parallel__virtual_pipeline_stages_per_rank": 2, "model__num_layers": 2,
          "parallel__pipeline_layers_per_stage": [1, 0, 0, 1]}, None, "middle stage 1 would hold nothing"),
        ({"training__compile": True, "parallel__pipeline_model_parallel_size": 2, "parallel__pipeline_schedule": "GPipe"},
         None, "training.compile=true is not supported with parallel.pipeline_schedule='GPipe'"),
        # Compile: refused where no parity test covers it (recomputation anywhere, layout-invariant dropout under tp).
        ({"training__compile": True, "parallel__tensor_model_parallel_size": 2, "training__recompute_granularity": "selective"},
         None, "training.compile=true is not supported with training.recompute_granularity='selective': no parity test"),
        ({"training__compile": True, "parallel__data_parallel_shard_size": 2, "training__recompute_granularity": "full",
          "training__recompute_method": "uniform", "training__recompute_num_layers": 1}, 2,
         "training.compile=true is not supported with training.recompute_granularity='full'"),
        ({"training__compile": True, "parallel__tensor_model_parallel_size": 2, "model__dropout_rng": "layout_invariant"},
         None, "training.compile=true is not supported with model.dropout_rng='layout_invariant' under "
               "parallel.tensor_model_parallel_size=2"),
        ({"training__compile": True, "parallel__tensor_model_parallel_size": 2, "model__position_embedding_type": "rope", **NO_DROPOUT},
         None, "training.compile=true is not supported with model.position_embedding_type='rope' under "
               "parallel.tensor_model_parallel_size=2: torch 2.13's compiled backward"),
        # Context parallelism: whole chunk pairs per rank (and per tp rank under SP); dropout only
        # with the layout-invariant RNG (Megatron's streams have no cp term).
        ({"parallel__context_parallel_size": 3, "model__seq_length": 16, **NO_DROPOUT}, None,
         "model.seq_length=16 must be divisible by 2 * parallel.context_parallel_size=3 = 6"),
        ({"parallel__context_parallel_size": 2, "parallel__tensor_model_parallel_size": 4, "parallel__sequence_parallel": True,
          "model__seq_length": 24, **NO_DROPOUT}, None,
         "model.seq_length=24 must be divisible by 2 * parallel.context_parallel_size=2 * tensor_model_parallel_size=4 "
         "(sequence parallel) = 16"),
        ({"parallel__context_parallel_size": 2, "model__hidden_dropout": 0.0, "model__attention_dropout": 0.1}, None,
         "model.attention_dropout=0.1 must be 0 with parallel.context_parallel_size=2 under model.dropout_rng='megatron'"),
        ({"parallel__context_parallel_size": 2, "model__attention_dropout": 0.0}, None,
         "model.hidden_dropout=0.1 must be 0 with parallel.context_parallel_size=2 under model.dropout_rng='megatron' "
         "(cp ranks would draw the same mask for different chunks of a sequence); set it to 0 or "
         "model.dropout_rng='layout_invariant'"),
        ({"model__dropout_rng": "philox"}, None, "model.dropout_rng='philox' is not one of: 'megatron', 'layout_invariant'"),
        ({"parallel__context_parallel_size": 2, **NO_DROPOUT, "parallel__data_parallel_shard_size": 2}, 2,
         "world size 2 != pipeline_model_parallel_size=1 * data_parallel_replicate_size=1 * data_parallel_shard_size=2 "
         "* context_parallel_size=2"),
        ({"parallel__context_parallel_size": 0}, None, "parallel.context_parallel_size=0 must be > 0"),
        # The LR schedule's lengths, in samples (config/derived.py computes them for validation and optim).
        ({"optimizer__lr_warmup_samples": 100_000}, None, "optimizer.lr_warmup_samples=100000 must be < the decay length"),
        ({"optimizer__lr_decay_samples": 0}, None, "optimizer.lr_decay_samples=0 must be > 0"),
        ({"optimizer__lr_warmup_iters": -1}, None, "optimizer.lr_warmup_iters=-1 must be >= 0"),
        ({"optimizer__lr_decay_style": "WSD"}, None, "needs the anneal length: set optimizer.lr_wsd_decay_iters"),
        ({"optimizer__lr_decay_style": "WSD", "optimizer__lr_wsd_decay_samples": 0}, None, "lr_wsd_decay_samples=0 must be > 0"),
        ({"optimizer__lr_decay_style": "WSD", "optimizer__lr_wsd_decay_iters": 10**9}, None, "must fit between the end of warmup"),
        ({"training__rampup_batch_size": [4, 2, 100], "training__global_batch_size": 8}, 4,
         "training.rampup_batch_size increment=2 must be divisible by micro_batch_size=1 * data-parallel size 4"),
        ({"data__tokenizer_type": "NullTokenizer", "data__vocab_size": 100, "model__make_vocab_size_divisible_by": 1,
          "parallel__tensor_model_parallel_size": 8, "model__num_attention_heads": 8, "model__hidden_size": 64},
         None, "parallel.tensor_model_parallel_size=8 must divide the padded vocabulary 100"),
    ],
)
def test_validation_errors_name_key_value_rule(overrides, world, expected):
    assert expected in error_of(base(**overrides), world)


@pytest.mark.parametrize("schedule", [s for s in PIPELINE_SCHEDULES if s != "DualPipeV"])
def test_every_other_schedule_validates_every_micro_batch_count(schedule):
    """A ramp-up through 1 to 16 micro-batches on pp 4 (8 stages when interleaved): fewer than the
    stages, and counts torch's interleaved rounds do not divide, all run (dtgpt.parallel.schedules)."""
    vpp = 2 if schedule in MULTI_STAGE_SCHEDULES else 1
    validate(base(parallel__pipeline_model_parallel_size=4, parallel__pipeline_schedule=schedule, model__num_layers=8,
                  parallel__virtual_pipeline_stages_per_rank=vpp, training__global_batch_size=16,
                  training__rampup_batch_size=[1, 1, 100]), 4)  # fmt: skip


def test_gpt3_175b_validates_at_256_gpus():
    """dp 2: the ramp-up starts at 16 / 2 = 8 micro-batches on 16 stages (1F1B's capped warm-up)."""
    validate(load_config(str(REPO / "configs" / "gpt3_175b.toml")), 256)


def test_dropout_with_cp_needs_the_layout_invariant_rng():
    validate(base(parallel__context_parallel_size=2, model__dropout_rng="layout_invariant"), 2)  # dropout 0.1 both
    validate(base(parallel__context_parallel_size=2, **NO_DROPOUT), 2)


def test_compile_is_allowed_where_parity_tests_cover_it():
    validate(base(training__compile=True, parallel__tensor_model_parallel_size=2, **NO_DROPOUT), 2)
    validate(base(training__compile=True, parallel__data_parallel_shard_size=2), 2)  # dropout at tp 1: no tp regions


def test_mesh_rest_of_world():
    cfg = base(parallel__tensor_model_parallel_size=2)
    validate_mesh(cfg, 8)  # dp_shard = 8 / 2 = 4
    with pytest.raises(ConfigError, match="world size 6 is not divisible.*launch a multiple of 4 ranks"):
        validate_mesh(base(parallel__tensor_model_parallel_size=4), 6)
    with pytest.raises(ConfigError, match="launch 4 ranks, or set parallel.data_parallel_shard_size=-1"):
        validate_mesh(base(parallel__data_parallel_shard_size=4), 2)


def test_split_overrides():
    assert split_overrides(["--a.b=1", "--c.d", "2"]) == [("a.b", "1"), ("c.d", "2")]


def _train(*args):
    return subprocess.run([sys.executable, str(REPO / "train.py"), *args], capture_output=True, text=True, cwd=REPO)


@pytest.mark.slow
def test_cli_print_config_and_clean_errors():
    out = _train("--config", "configs/gpt3_175b.toml", "--print-config")
    assert out.returncode == 0, out.stderr
    assert "num_layers = 96" in out.stdout and "rampup_batch_size = [16, 16, 5859375]" in out.stdout
    bad = _train("--config", "configs/debug.toml", "--model.hiden_size=3")
    assert bad.returncode == 2
    assert "did you mean 'hidden_size'" in bad.stderr and "Traceback" not in bad.stderr


def test_derived_helpers_raise_validations_message():
    """Builders call the helpers validation calls, so a value only known at run time (the tokenizer's
    vocabulary, a ramp-up batch) fails with the message validation gives."""
    cfg = base(parallel__tensor_model_parallel_size=8, model__num_attention_heads=8, model__hidden_size=64,
               model__make_vocab_size_divisible_by=4)  # fmt: skip
    assert padded_vocabulary(cfg, 262) == 264
    with pytest.raises(ConfigError, match=r"^parallel.tensor_model_parallel_size=8 must divide the padded vocabulary 260; "):
        padded_vocabulary(cfg, 257)
    assert num_microbatches(base(training__micro_batch_size=2), 4, 32) == 4
    validation_says = error_of(base(training__global_batch_size=6), 4)
    with pytest.raises(ConfigError) as helper:
        num_microbatches(base(), 4, 6)
    assert str(helper.value) == validation_says


def test_mesh_shape_resolves_the_rest():
    cfg = base(parallel__tensor_model_parallel_size=2, parallel__pipeline_model_parallel_size=2,
               parallel__data_parallel_replicate_size=2, model__num_layers=2)  # fmt: skip
    assert mesh_shape(cfg, 16) == (2, 2, 2, 1, 2)
    assert data_parallel_size(cfg, 16) == 4
    cfg.parallel.context_parallel_size = 2  # cp ranks read the same samples: not data-parallel
    assert mesh_shape(cfg, 16) == (2, 2, 1, 2, 2)
    assert data_parallel_size(cfg, 16) == 2


# --- which key wins (dtgpt/config/precedence.py) -------------------------------------------


def _file(tmp_path, text: str) -> str:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return str(path)


def test_command_line_data_source_replaces_the_files(tmp_path):
    """--data.data_path on a config that names the built-in corpus trains on the given data."""
    cfg = load_config(REPO / "configs/debug.toml", ["--data.data_path=/data/corpus"])
    assert cfg.data.data_path == ["/data/corpus"] and cfg.data.builtin_corpus == ""


def test_builtin_corpus_on_the_command_line_drops_the_files_tokenizer():
    """The README's small-mesh command: gpt3_175b.toml names GPT-2 BPE files; the built-in
    corpus given on the command line implies the byte tokenizer."""
    cfg = load_config(REPO / "configs/gpt3_175b.toml", ["--data.builtin_corpus=python-docstrings"])
    d = cfg.data
    assert (d.builtin_corpus, d.tokenizer_type, d.vocab_file, d.merge_file, d.data_path) == (
        "python-docstrings", "ByteTokenizer", "", "", []
    )


def test_command_line_tokenizer_replaces_the_files_builtin_corpus(tmp_path):
    cfg = load_config(
        REPO / "configs/debug.toml",
        ["--data.tokenizer_type=NullTokenizer", "--data.vocab_size=128", "--data.mock_data=true"],
    )
    assert cfg.data.builtin_corpus == "" and cfg.data.tokenizer_type == "NullTokenizer" and cfg.data.mock_data


def test_command_line_warmup_replaces_the_files():
    cfg = load_config(REPO / "configs/debug.toml", ["--optimizer.lr_warmup_iters=5"])
    assert cfg.optimizer.lr_warmup_iters == 5 and cfg.optimizer.lr_warmup_fraction is None


@pytest.mark.parametrize(
    "text,overrides,keys",
    [
        ("[data]\nmock_data = true\ndata_path = ['x']\n", [], ("data.mock_data", "data.data_path")),
        ("[data]\nmock_data = true\n", ["--data.builtin_corpus=python-docstrings", "--data.data_path=x"],
         ("data.builtin_corpus", "data.data_path")),
        ("[data]\nbuiltin_corpus = 'python-docstrings'\nvocab_file = 'v.json'\n", [],
         ("data.builtin_corpus", "data.vocab_file")),
        ("[data]\nmock_data = true\n[optimizer]\nlr_warmup_iters = 3\nlr_warmup_fraction = 0.1\n", [],
         ("optimizer.lr_warmup_fraction", "optimizer.lr_warmup_iters")),
    ],
    ids=["file-file", "cli-cli", "corpus-vs-vocab", "two-warmups"],
)
def test_two_choices_in_one_place_are_refused_naming_both(tmp_path, text, overrides, keys):
    with pytest.raises(ConfigError) as info:
        load_config(_file(tmp_path, text), overrides)
    message = str(info.value)
    assert all(k in message for k in keys) and "cannot both be set" in message, message


def test_make_config_refuses_two_data_sources():
    with pytest.raises(ConfigError, match="data.mock_data=True and data.data_path"):
        validate(config_from_dict({"data": {"mock_data": True, "data_path": ["x"]}}))


def test_none_unsets_a_string_key():
    cfg = load_config(REPO / "configs/gpt3_175b.toml", ["--data.vocab_file=none", "--data.merge_file=None"])
    assert cfg.data.vocab_file == "" and cfg.data.merge_file == ""
