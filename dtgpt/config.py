"""Configuration: one dataclass per TOML section, Megatron's argument names in snake_case.

Load a TOML file, apply `--section.key=value` overrides, validate once, then pass the
`Config` object down explicitly. Nothing here reads global state.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib


class ConfigError(ValueError):
    """A config problem a user can fix; the message names the key, the value and the rule."""


@dataclass
class ModelConfig:
    num_layers: int = 2
    """Transformer blocks."""
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: int = 0
    """MLP width; 0 means 4 * hidden_size."""
    seq_length: int = 128
    max_position_embeddings: int = 0
    """Rows of the learned position table; 0 means seq_length."""
    init_method_std: float = 0.02
    position_embedding_type: str = "learned_absolute"
    """'learned_absolute' (GPT-3) or 'rope'."""
    rotary_base: int = 10000
    normalization: str = "LayerNorm"
    """'LayerNorm' (GPT-3) or 'RMSNorm'."""
    norm_epsilon: float = 1e-5
    untie_embeddings_and_output_weights: bool = False
    make_vocab_size_divisible_by: int = 128
    """The vocabulary is padded to a multiple of this alone (never times tp), so the model is mesh-free."""
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length


@dataclass
class TrainingConfig:
    micro_batch_size: int = 1
    global_batch_size: int = 8
    rampup_batch_size: list[int] = field(default_factory=list)
    """[start, increment, ramp_samples]; empty means no ramp-up."""
    train_iters: int = 100
    seed: int = 1234
    fp16: bool = False
    bf16: bool = False
    activation_checkpointing: str = "none"
    """'none', 'full' (every block) or 'selective' (every k-th block, see activation_checkpointing_every)."""
    activation_checkpointing_every: int = 2
    compile: bool = False
    """torch.compile the whole model (per stage under pipeline parallelism)."""
    device: str = "auto"
    """'auto' (CUDA when present, else CPU), 'cpu' or 'cuda'."""
    nan_policy: str = "skip"
    """What a non-finite loss does: 'skip' the iteration or 'stop' the run."""


@dataclass
class OptimizerConfig:
    lr: float = 3e-4
    min_lr: float = 0.0
    lr_decay_style: str = "linear"
    """'constant', 'linear', 'cosine', 'inverse-square-root' or 'WSD'."""
    lr_decay_iters: Optional[int] = None
    """Decay length in iterations (times global_batch_size in samples); default train_iters."""
    lr_decay_samples: Optional[int] = None
    lr_warmup_fraction: Optional[float] = None
    """Warmup as a fraction of the decay length; wins over lr_warmup_iters."""
    lr_warmup_iters: int = 0
    lr_warmup_samples: int = 0
    lr_warmup_init: float = 0.0
    lr_wsd_decay_style: str = "exponential"
    """Anneal of WSD: 'linear', 'cosine', 'exponential' or 'minus_sqrt'."""
    lr_wsd_decay_iters: Optional[int] = None
    lr_wsd_decay_samples: Optional[int] = None
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Max global gradient norm; 0 disables clipping."""
    loss_scale: Optional[float] = None
    """A static fp16 loss scale; unset means dynamic scaling."""
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    data_parallel_shard_size: int = -1
    """FSDP shard degree; -1 means whatever the world size leaves."""
    data_parallel_replicate_size: int = 1
    """HSDP replica count; > 1 replicates the FSDP shards."""
    sequence_parallel: bool = False
    pipeline_schedule: str = "1F1B"
    virtual_pipeline_stages_per_rank: int = 1
    pipeline_layers_per_stage: list[int] = field(default_factory=list)
    """Explicit layer count per stage (pp * virtual entries); empty means an even split."""
    loss_parallel: bool = True
    """Under tp, cross-entropy on vocabulary-sharded logits (no full-logit gather)."""
    fsdp_reshard_after_forward: str = "default"
    """'default' (on without pp, off with pp), 'always' or 'never'."""


@dataclass
class DataConfig:
    data_path: list[str] = field(default_factory=list)
    """Megatron's blend list: ["0.3", "prefA", "0.7", "prefB"]; a bare prefix has weight 1."""
    train_data_path: list[str] = field(default_factory=list)
    valid_data_path: list[str] = field(default_factory=list)
    test_data_path: list[str] = field(default_factory=list)
    split: str = "969,30,1"
    mock_data: bool = False
    builtin_corpus: str = ""
    """'python-docstrings': text gathered from the installed standard library, no download."""
    tokenizer_type: str = "GPT2BPETokenizer"
    """'GPT2BPETokenizer', 'ByteTokenizer' or 'NullTokenizer'."""
    vocab_file: str = ""
    merge_file: str = ""
    vocab_size: int = 0
    """Vocabulary of NullTokenizer (and of mock data when no tokenizer file is given)."""
    data_cache_path: str = ""
    """Where index arrays (and the built-in corpus) are cached; default next to the data."""
    num_workers: int = 2


@dataclass
class CheckpointConfig:
    save: str = ""
    load: str = ""
    load_iteration: int = 0
    """Load this iteration instead of the one latest_checkpointed_iteration.txt names."""
    load_optimizer: bool = True
    auto_resume: bool = False
    save_interval: int = 0
    async_save: bool = False
    keep_last: int = 0
    """Keep this many newest iterations (0 keeps all)."""
    exit_signal_handler: Optional[bool] = None
    """SIGTERM/SIGINT: every rank finishes the iteration, saves, exits 0. Unset: on when
    checkpoint.save is set (Megatron's default is off; see docs/faults.md)."""
    exit_duration_in_mins: float = 0.0
    exit_interval: int = 0


@dataclass
class LoggingConfig:
    log_interval: int = 10
    tensorboard_dir: str = ""
    metrics_file: str = ""
    """One JSON object per iteration."""
    peak_tflops: float = 0.0
    """Dense peak per device for MFU; 0 looks the device up in a table."""
    timers_log_level: int = 0


@dataclass
class EvalConfig:
    eval_interval: int = 1000
    eval_iters: int = 10


@dataclass
class DistributedConfig:
    backend: str = "auto"
    """'auto' (nccl on CUDA, gloo on CPU), 'nccl' or 'gloo'."""
    timeout_minutes: float = 10.0
    """Collective timeout: a dead or stuck peer becomes an error after this long, not a hang."""
    heartbeat_factor: float = 10.0
    """Print a heartbeat when a phase runs this many times the median iteration (0 disables)."""
    heartbeat_min_seconds: float = 30.0
    """...and at least this long; the heartbeat then repeats at this interval."""


@dataclass
class ProfilingConfig:
    profile_step_start: int = 0
    """First iteration traced by torch.profiler; 0 disables profiling."""
    profile_step_end: int = 0
    """The trace is written when this iteration starts (exclusive)."""
    trace_dir: str = ""
    """Each rank writes rank{N}.*.pt.trace.json here (TensorBoard's profiler plugin reads it)."""
    memory_snapshot_path: str = ""
    """CUDA only: an allocator-history pickle over the window ('{rank}' is filled in)."""


@dataclass
class FaultsConfig:
    """Deliberate faults for drills and tests; empty in real runs."""

    nan_at_iterations: list[int] = field(default_factory=list)
    """Make the loss and one gradient non-finite at these iterations (tests the NaN guard)."""
    kill_at_iteration: int = 0
    """SIGKILL rank kill_rank during this iteration (0: never). Like every fault below, only on
    the first attempt: a group restarted by torchrun (TORCHELASTIC_RESTART_COUNT > 0) runs clean."""
    kill_rank: int = 0
    kill_during_save: bool = False
    """Kill in the checkpoint save of kill_at_iteration instead, after this rank wrote its data."""
    hang_at_iteration: int = 0
    """Rank hang_rank sleeps forever in this iteration (0: never): a stuck peer."""
    hang_rank: int = 0
    signal_at_iteration: int = 0
    """Rank signal_rank sends itself signal_name in this iteration, and SIGTERM and SIGINT again
    while the checkpoint that follows is written (0: never)."""
    signal_rank: int = 0
    signal_name: str = "SIGTERM"
    disk_full_at_iteration: int = 0
    """The checkpoint save of this iteration fails with ENOSPC on rank disk_full_rank, after
    writing part of its data (0: never)."""
    disk_full_rank: int = 0


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)


# Keys that parse but whose feature is not built yet: set to anything but the default, they are
# reported at start-up instead of being ignored.
NOT_BUILT: tuple[str, ...] = ()


# ---------------------------------------------------------------------------------------------
# Types and coercion


def _field_types(section_cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_cls)}


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return tp, False


def _type_name(tp: Any) -> str:
    inner, optional = _unwrap_optional(tp)
    if typing.get_origin(inner) is list:
        name = f"list of {typing.get_args(inner)[0].__name__}"
    else:
        name = inner.__name__
    return f"{name} (or unset)" if optional else name


def _check_value(key: str, value: Any, tp: Any) -> Any:
    """Check a value read from TOML against the field type; ints are accepted for floats."""
    inner, optional = _unwrap_optional(tp)
    if value is None and optional:
        return None
    if typing.get_origin(inner) is list:
        elem = typing.get_args(inner)[0]
        if not isinstance(value, list):
            raise ConfigError(f"{key}={value!r} must be a {_type_name(tp)}")
        return [_check_value(f"{key}[{i}]", v, elem) for i, v in enumerate(value)]
    if inner is bool:
        ok = isinstance(value, bool)
    elif inner is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif inner is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, inner)
    if not ok:
        raise ConfigError(f"{key}={value!r} must be a {_type_name(tp)}")
    return value


def _coerce_text(key: str, text: str, tp: Any) -> Any:
    """Turn a command-line string into the field's type."""
    inner, optional = _unwrap_optional(tp)
    if optional and text.lower() in ("none", "null", ""):
        return None
    if typing.get_origin(inner) is list:
        elem = typing.get_args(inner)[0]
        stripped = text.strip()
        if stripped.startswith("["):
            try:
                parsed = tomllib.loads(f"v = {stripped}")["v"]
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"{key}={text!r} is not a valid list: {e}") from None
            return _check_value(key, parsed, tp)
        parts = [p for p in stripped.replace(",", " ").split() if p]
        return [_coerce_text(f"{key}[{i}]", p, elem) for i, p in enumerate(parts)]
    try:
        if inner is bool:
            lowered = text.lower()
            if lowered in ("true", "1", "yes", "on"):
                return True
            if lowered in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if inner is int:
            return int(text)
        if inner is float:
            return float(text)
    except ValueError:
        raise ConfigError(f"{key}={text!r} must be a {_type_name(tp)}") from None
    return text


def _closest(name: str, choices: list[str]) -> str:
    match = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else f"; valid names: {', '.join(choices)}"


def _section_classes() -> dict[str, type]:
    return {f.name: f.default_factory for f in dataclasses.fields(Config)}  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------
# Loading


def config_from_dict(data: dict[str, Any], source: str = "config") -> Config:
    """Build a Config from nested dicts, rejecting unknown sections and keys by name."""
    sections = _section_classes()
    cfg = Config()
    for section_name, values in data.items():
        if section_name not in sections:
            raise ConfigError(
                f"{source}: unknown section [{section_name}]{_closest(section_name, list(sections))}"
            )
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: [{section_name}] must be a table of keys")
        section = getattr(cfg, section_name)
        types_ = _field_types(type(section))
        for key, value in values.items():
            if key not in types_:
                raise ConfigError(
                    f"{source}: unknown key {section_name}.{key}{_closest(key, list(types_))}"
                )
            setattr(section, key, _check_value(f"{section_name}.{key}", value, types_[key]))
    return cfg


def load_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: malformed TOML: {e}") from None


def apply_override(cfg: Config, dotted_key: str, text: str) -> None:
    """Apply one `section.key=value` override given as text."""
    sections = _section_classes()
    if "." not in dotted_key:
        raise ConfigError(f"override --{dotted_key} must look like --section.key=value")
    section_name, key = dotted_key.split(".", 1)
    if section_name not in sections:
        raise ConfigError(f"unknown section in --{dotted_key}{_closest(section_name, list(sections))}")
    section = getattr(cfg, section_name)
    types_ = _field_types(type(section))
    if key not in types_:
        raise ConfigError(f"unknown key --{dotted_key}{_closest(key, list(types_))}")
    setattr(section, key, _coerce_text(dotted_key, text, types_[key]))


def split_overrides(args: list[str]) -> list[tuple[str, str]]:
    """`--a.b=1 --c.d 2` -> [("a.b", "1"), ("c.d", "2")]."""
    pairs = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"unexpected argument {arg!r}; overrides look like --section.key=value")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override {arg} has no value")
            key, value = arg[2:], args[i + 1]
            i += 2
        pairs.append((key, value))
    return pairs


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Read a TOML file (or the defaults when path is None), apply overrides, validate."""
    cfg = config_from_dict(load_toml(path), str(path)) if path else Config()
    for key, value in split_overrides(list(overrides)):
        apply_override(cfg, key, value)
    validate(cfg)
    return cfg


# ---------------------------------------------------------------------------------------------
# Validation

PIPELINE_SCHEDULES = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
# Schedules that place two or more stages on every rank.
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
V_SHAPED_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")

_CHOICES = {
    "model.position_embedding_type": ("learned_absolute", "rope"),
    "model.normalization": ("LayerNorm", "RMSNorm"),
    "training.activation_checkpointing": ("none", "full", "selective"),
    "training.device": ("auto", "cpu", "cuda"),
    "training.nan_policy": ("skip", "stop"),
    "optimizer.lr_decay_style": ("constant", "linear", "cosine", "inverse-square-root", "WSD"),
    "optimizer.lr_wsd_decay_style": ("linear", "cosine", "exponential", "minus_sqrt"),
    "parallel.pipeline_schedule": PIPELINE_SCHEDULES,
    "parallel.fsdp_reshard_after_forward": ("default", "always", "never"),
    "data.tokenizer_type": ("GPT2BPETokenizer", "ByteTokenizer", "NullTokenizer"),
    "data.builtin_corpus": ("", "python-docstrings"),
    "distributed.backend": ("auto", "nccl", "gloo"),
    "faults.signal_name": ("SIGTERM", "SIGINT"),
}

FAULT_RANKS = ("faults.kill_rank", "faults.hang_rank", "faults.signal_rank", "faults.disk_full_rank")

_POSITIVE = (
    "model.num_layers",
    "model.hidden_size",
    "model.num_attention_heads",
    "model.seq_length",
    "model.make_vocab_size_divisible_by",
    "training.micro_batch_size",
    "training.global_batch_size",
    "training.train_iters",
    "training.activation_checkpointing_every",
    "parallel.tensor_model_parallel_size",
    "parallel.pipeline_model_parallel_size",
    "parallel.data_parallel_replicate_size",
    "parallel.virtual_pipeline_stages_per_rank",
    "logging.log_interval",
    "eval.eval_interval",
    "distributed.timeout_minutes",
)


def get_key(cfg: Config, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def num_pipeline_stages(cfg: Config) -> int:
    p = cfg.parallel
    return p.pipeline_model_parallel_size * p.virtual_pipeline_stages_per_rank


def data_parallel_size(cfg: Config, world_size: int) -> int:
    """dp = world / (pp * tp) when dp_shard is -1, else dp_replicate * dp_shard."""
    p = cfg.parallel
    if p.data_parallel_shard_size == -1:
        return world_size // (p.pipeline_model_parallel_size * p.tensor_model_parallel_size)
    return p.data_parallel_replicate_size * p.data_parallel_shard_size


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Check every rule that needs no process group; with world_size, the mesh rules too."""
    for key, choices in _CHOICES.items():
        value = get_key(cfg, key)
        _require(value in choices, f"{key}={value!r} is not one of: {', '.join(map(repr, choices))}")
    for key in _POSITIVE:
        value = get_key(cfg, key)
        _require(value > 0, f"{key}={value} must be > 0")
    m, t, o, p, d = cfg.model, cfg.training, cfg.optimizer, cfg.parallel, cfg.data
    tp, pp, vpp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.virtual_pipeline_stages_per_rank

    # model shape
    _require(
        m.hidden_size % m.num_attention_heads == 0,
        f"model.num_attention_heads={m.num_attention_heads} must divide model.hidden_size={m.hidden_size}",
    )
    head_dim = m.hidden_size // m.num_attention_heads
    _require(
        m.position_embedding_type != "rope" or head_dim % 2 == 0,
        f"model.position_embedding_type='rope' needs an even head size, got hidden_size/heads={head_dim}",
    )
    _require(
        m.seq_length <= m.max_positions,
        f"model.seq_length={m.seq_length} must be <= model.max_position_embeddings={m.max_position_embeddings}",
    )
    _require(m.ffn_hidden_size >= 0, f"model.ffn_hidden_size={m.ffn_hidden_size} must be >= 0 (0 = 4*hidden)")
    _require(m.init_method_std > 0, f"model.init_method_std={m.init_method_std} must be > 0")
    for key in ("model.hidden_dropout", "model.attention_dropout"):
        _require(0.0 <= get_key(cfg, key) < 1.0, f"{key}={get_key(cfg, key)} must be in [0, 1)")

    # tensor parallel
    _require(
        m.num_attention_heads % tp == 0,
        f"parallel.tensor_model_parallel_size={tp} must divide model.num_attention_heads={m.num_attention_heads}",
    )
    _require(
        m.ffn_size % tp == 0,
        f"parallel.tensor_model_parallel_size={tp} must divide the MLP width model.ffn_hidden_size={m.ffn_size}",
    )
    _require(
        not (p.sequence_parallel and tp > 1) or m.seq_length % tp == 0,
        f"parallel.tensor_model_parallel_size={tp} must divide model.seq_length={m.seq_length} "
        "under parallel.sequence_parallel=true",
    )

    # pipeline parallel
    stages = pp * vpp
    if p.pipeline_layers_per_stage:
        counts = p.pipeline_layers_per_stage
        _require(
            len(counts) == stages,
            f"parallel.pipeline_layers_per_stage has {len(counts)} entries; it needs one per stage "
            f"(pipeline_model_parallel_size * virtual_pipeline_stages_per_rank = {stages})",
        )
        _require(
            sum(counts) == m.num_layers and min(counts) >= 0,
            f"parallel.pipeline_layers_per_stage={counts} must be >= 0 and sum to model.num_layers={m.num_layers}",
        )
        empty = [i for i, c in enumerate(counts[1:-1], start=1) if c == 0]
        _require(
            not empty,
            f"parallel.pipeline_layers_per_stage={counts}: middle stage {empty[0] if empty else ''} would hold "
            "nothing (only the first stage may be just the embedding, the last just the head)",
        )
    else:
        _require(
            m.num_layers % stages == 0,
            f"model.num_layers={m.num_layers} must be divisible by the number of pipeline stages "
            f"(pipeline_model_parallel_size={pp} * virtual_pipeline_stages_per_rank={vpp} = {stages}); "
            "or give parallel.pipeline_layers_per_stage",
        )
    if pp > 1 or vpp > 1:
        multi = p.pipeline_schedule in MULTI_STAGE_SCHEDULES
        if multi:
            _require(
                vpp >= 2,
                f"parallel.pipeline_schedule={p.pipeline_schedule!r} places several stages per rank: "
                f"set parallel.virtual_pipeline_stages_per_rank >= 2 (got {vpp})",
            )
        else:
            _require(
                vpp == 1,
                f"parallel.virtual_pipeline_stages_per_rank={vpp} needs a multi-stage schedule "
                f"({', '.join(MULTI_STAGE_SCHEDULES)}), not parallel.pipeline_schedule={p.pipeline_schedule!r}",
            )
        if p.pipeline_schedule in V_SHAPED_SCHEDULES:
            _require(
                vpp == 2,
                f"parallel.pipeline_schedule={p.pipeline_schedule!r} is V-shaped and needs "
                f"parallel.virtual_pipeline_stages_per_rank=2 (got {vpp})",
            )

    # compile: only where a parity test shows it trains the same model
    _require(
        not t.compile or (tp == 1 and pp == 1),
        f"training.compile=true is not supported with parallel.tensor_model_parallel_size={tp} or "
        f"parallel.pipeline_model_parallel_size={pp} (> 1): compiling parts of a tensor-parallel model fails or "
        "gives wrong gradients, and no parity test covers these combinations yet; set training.compile=false",
    )

    # batch sizes
    _require(
        t.global_batch_size % t.micro_batch_size == 0,
        f"training.micro_batch_size={t.micro_batch_size} must divide training.global_batch_size={t.global_batch_size}",
    )
    if t.rampup_batch_size:
        _require(
            len(t.rampup_batch_size) == 3,
            f"training.rampup_batch_size={t.rampup_batch_size} must be [start, increment, ramp_samples]",
        )
        start, incr, samples = t.rampup_batch_size
        _require(start > 0 and incr > 0 and samples >= 0, f"training.rampup_batch_size={t.rampup_batch_size} needs start > 0, increment > 0, samples >= 0")
        _require(
            start <= t.global_batch_size and (t.global_batch_size - start) % incr == 0,
            f"training.rampup_batch_size={t.rampup_batch_size}: global_batch_size={t.global_batch_size} - start "
            f"must be a non-negative multiple of the increment",
        )

    # precision
    _require(not (t.fp16 and t.bf16), "training.fp16=true and training.bf16=true cannot both be set")
    _require(o.initial_loss_scale > 0 and o.min_loss_scale > 0, "optimizer.initial_loss_scale and min_loss_scale must be > 0")
    _require(o.hysteresis >= 1, f"optimizer.hysteresis={o.hysteresis} must be >= 1")
    _require(o.loss_scale_window >= 1, f"optimizer.loss_scale_window={o.loss_scale_window} must be >= 1")

    # learning rate
    _require(o.lr >= 0 and o.min_lr >= 0, f"optimizer.lr={o.lr} and optimizer.min_lr={o.min_lr} must be >= 0")
    _require(o.min_lr <= o.lr, f"optimizer.min_lr={o.min_lr} must be <= optimizer.lr={o.lr}")
    _require(o.clip_grad >= 0, f"optimizer.clip_grad={o.clip_grad} must be >= 0 (0 disables clipping)")
    _require(o.weight_decay >= 0, f"optimizer.weight_decay={o.weight_decay} must be >= 0")
    if o.lr_warmup_fraction is not None:
        _require(
            0.0 <= o.lr_warmup_fraction < 1.0,
            f"optimizer.lr_warmup_fraction={o.lr_warmup_fraction} must be in [0, 1) (warmup < decay)",
        )
    decay_iters = o.lr_decay_iters if o.lr_decay_iters is not None else t.train_iters
    _require(decay_iters > 0, f"optimizer.lr_decay_iters={o.lr_decay_iters} must be > 0")
    if o.lr_decay_samples is None and o.lr_warmup_fraction is None and not o.lr_warmup_samples:
        _require(
            o.lr_warmup_iters < decay_iters,
            f"optimizer.lr_warmup_iters={o.lr_warmup_iters} must be < the decay length "
            f"optimizer.lr_decay_iters={decay_iters} (warmup < decay)",
        )
    if o.lr_decay_samples is not None and o.lr_warmup_samples:
        _require(
            o.lr_warmup_samples < o.lr_decay_samples,
            f"optimizer.lr_warmup_samples={o.lr_warmup_samples} must be < optimizer.lr_decay_samples={o.lr_decay_samples}",
        )

    # data
    has_data = d.mock_data or d.builtin_corpus or d.data_path or d.train_data_path
    _require(
        bool(has_data),
        "no training data: set data.data_path (or data.train_data_path), data.builtin_corpus, or data.mock_data=true",
    )
    _require(d.num_workers >= 0, f"data.num_workers={d.num_workers} must be >= 0")
    _require(
        d.tokenizer_type != "NullTokenizer" or d.vocab_size > 0,
        f"data.tokenizer_type='NullTokenizer' needs data.vocab_size > 0 (got {d.vocab_size})",
    )
    split = [s for s in d.split.replace("/", ",").split(",") if s.strip()]
    try:
        weights = [float(s) for s in split]
    except ValueError:
        raise ConfigError(f"data.split={d.split!r} must be comma-separated numbers like '949,50,1'") from None
    _require(
        1 <= len(weights) <= 3 and all(w >= 0 for w in weights) and sum(weights) > 0,
        f"data.split={d.split!r} needs 1-3 non-negative weights with a positive sum",
    )

    # checkpoint and logging
    c = cfg.checkpoint
    for key in ("checkpoint.save_interval", "checkpoint.keep_last", "checkpoint.exit_interval", "checkpoint.load_iteration"):
        _require(get_key(cfg, key) >= 0, f"{key}={get_key(cfg, key)} must be >= 0")
    _require(c.exit_duration_in_mins >= 0, f"checkpoint.exit_duration_in_mins={c.exit_duration_in_mins} must be >= 0")
    _require(cfg.eval.eval_iters >= 0, f"eval.eval_iters={cfg.eval.eval_iters} must be >= 0")
    _require(
        cfg.logging.timers_log_level in (0, 1, 2),
        f"logging.timers_log_level={cfg.logging.timers_log_level} must be 0, 1 or 2",
    )

    _require(
        cfg.distributed.heartbeat_min_seconds > 0,
        f"distributed.heartbeat_min_seconds={cfg.distributed.heartbeat_min_seconds} must be > 0",
    )
    for key in FAULT_RANKS:
        _require(get_key(cfg, key) >= 0, f"{key}={get_key(cfg, key)} must be >= 0")
        at = key.replace("_rank", "_at_iteration")
        _require(get_key(cfg, at) >= 0, f"{at}={get_key(cfg, at)} must be >= 0 (0: never)")

    prof = cfg.profiling
    if prof.profile_step_start > 0 and prof.trace_dir:
        _require(
            prof.profile_step_end > prof.profile_step_start,
            f"profiling.profile_step_end={prof.profile_step_end} must be > profiling.profile_step_start={prof.profile_step_start}",
        )

    if world_size is not None:
        validate_mesh(cfg, world_size)


def validate_mesh(cfg: Config, world_size: int) -> None:
    """Rules that need the world size: the mesh product and the batch split over dp."""
    p, t = cfg.parallel, cfg.training
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    dpr, dps = p.data_parallel_replicate_size, p.data_parallel_shard_size
    if dps == -1:
        _require(
            world_size % (pp * tp * dpr) == 0,
            f"world size {world_size} is not divisible by pipeline_model_parallel_size={pp} * "
            f"tensor_model_parallel_size={tp} * data_parallel_replicate_size={dpr}",
        )
    else:
        _require(dps > 0, f"parallel.data_parallel_shard_size={dps} must be > 0 or -1 (the rest)")
        _require(
            pp * dpr * dps * tp == world_size,
            f"world size {world_size} != pipeline_model_parallel_size={pp} * data_parallel_replicate_size={dpr} "
            f"* data_parallel_shard_size={dps} * tensor_model_parallel_size={tp} = {pp * dpr * dps * tp}",
        )
    for key in FAULT_RANKS:
        _require(get_key(cfg, key) < world_size, f"{key}={get_key(cfg, key)} must be < the world size {world_size}")
    dp = data_parallel_size(cfg, world_size)
    per_step = t.micro_batch_size * dp
    batch_sizes = [t.global_batch_size] + t.rampup_batch_size[:2]
    for name, size in zip(("training.global_batch_size", "training.rampup_batch_size start", "training.rampup_batch_size increment"), batch_sizes):
        _require(
            size % per_step == 0,
            f"{name}={size} must be divisible by micro_batch_size={t.micro_batch_size} * data-parallel size {dp} = {per_step}",
        )
    if pp > 1:
        stages = num_pipeline_stages(cfg)
        smallest = (t.rampup_batch_size[0] if t.rampup_batch_size else t.global_batch_size) // per_step
        if p.pipeline_schedule == "DualPipeV":
            _require(
                smallest >= stages,
                f"parallel.pipeline_schedule='DualPipeV' needs micro-batches per iteration >= stages ({stages}); "
                f"the smallest batch gives {smallest} (global_batch_size / (micro_batch_size * dp))",
            )
        elif p.pipeline_schedule in MULTI_STAGE_SCHEDULES and p.pipeline_schedule != "LoopedBFS":
            _require(
                smallest % pp == 0 or smallest >= stages,
                f"parallel.pipeline_schedule={p.pipeline_schedule!r} needs micro-batches per iteration to be a "
                f"multiple of pipeline_model_parallel_size={pp}; the smallest batch gives {smallest}",
            )


def unbuilt_keys(cfg: Config) -> list[str]:
    """Keys from NOT_BUILT that are set away from their default."""
    default = Config()
    return [k for k in NOT_BUILT if get_key(cfg, k) != get_key(default, k)]


# ---------------------------------------------------------------------------------------------
# Printing


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isinf(value) or math.isnan(value):
            return str(value).replace("inf", "inf").lower()
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML; unset optional keys appear as comments."""
    lines = []
    for section_field in dataclasses.fields(cfg):
        section = getattr(cfg, section_field.name)
        lines.append(f"[{section_field.name}]")
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if value is None:
                lines.append(f"# {f.name} = (unset)")
            else:
                lines.append(f"{f.name} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)
