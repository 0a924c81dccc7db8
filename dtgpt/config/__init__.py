"""Configuration: one dataclass per TOML section, Megatron's argument names in snake_case.

Load a TOML file, apply `--section.key=value` overrides, validate once, then pass the `Config`
object down explicitly. Nothing here reads global state.

    sections.py    the dataclasses (the config contract of DESIGN.md); run_keys.py holds
                   [distributed], [profiling] and [faults]
    loading.py     TOML, overrides, type coercion, closest-name suggestions, printing as TOML
    megatron_flags.py  Megatron-LM's flags (--num-layers 96 --fp16 ...) onto the keys: one table
                   derived from these dataclasses and Megatron's flag list (megatron_names.py)
    validation.py  the cross-field rules: every rule lives here once
    derived.py     one helper per derived quantity (mesh, micro-batches, padded vocabulary,
                   LR schedule lengths), shared by validation and the builders
    batch_schedule.py  the global batch by samples consumed (ramp-up, step schedule) and
                   the run's iteration count (train_iters, or derived from train_samples)
"""

from dtgpt.config.sections import (
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    DistributedConfig,
    EvalConfig,
    FaultsConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    ProfilingConfig,
    TrainingConfig,
)
from dtgpt.config.derived import (
    data_parallel_size,
    fsdp_reshards_after_forward,
    grads_reduced_in_fp32,
    interleaved_round_size,
    keys_on_token_index,
    layout_invariant_dropout,
    low_precision,
    mesh_shape,
    num_microbatches,
    num_pipeline_stages,
    padded_vocab_size,
    padded_vocabulary,
)
from dtgpt.config.loading import apply_override, config_from_dict, load_config, load_toml, split_overrides, to_toml
from dtgpt.config.parallel_rules import INTERLEAVED_SCHEDULES, MULTI_STAGE_SCHEDULES, PIPELINE_SCHEDULES, V_SHAPED_SCHEDULES
from dtgpt.config.validation import get_key, validate, validate_mesh

__all__ = [
    "CheckpointConfig", "Config", "ConfigError", "DataConfig", "DistributedConfig", "EvalConfig",
    "FaultsConfig", "LoggingConfig", "ModelConfig", "OptimizerConfig", "ParallelConfig",
    "ProfilingConfig", "TrainingConfig", "apply_override", "config_from_dict", "load_config",
    "load_toml", "split_overrides", "to_toml", "INTERLEAVED_SCHEDULES", "MULTI_STAGE_SCHEDULES", "PIPELINE_SCHEDULES",
    "V_SHAPED_SCHEDULES", "data_parallel_size", "fsdp_reshards_after_forward", "get_key", "grads_reduced_in_fp32", "interleaved_round_size", "keys_on_token_index", "layout_invariant_dropout", "low_precision", "mesh_shape", "num_microbatches",
    "num_pipeline_stages", "padded_vocab_size", "padded_vocabulary", "validate", "validate_mesh",
]  # fmt: skip
