"""The config sections: one dataclass per TOML section, Megatron's argument names in snake_case.

Loading and overrides live in dtgpt/config/loading.py, the rules in dtgpt/config/validation.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from dtgpt.config.attention_keys import AttentionVariantKeys
from dtgpt.config.checkpoint_keys import CheckpointKeys
from dtgpt.config.init_keys import InitKeys
from dtgpt.config.mla_keys import MLAKeys
from dtgpt.config.moe_keys import MoEKeys
from dtgpt.config.mtp_keys import MTPKeys
from dtgpt.config.muon_keys import MuonKeys
from dtgpt.config.pipeline_split_keys import PipelineSplitKeys
from dtgpt.config.run_keys import DistributedConfig, FaultsConfig, ProfilingConfig
from dtgpt.config.tokenizer_keys import TokenizerKeys
from dtgpt.config.weight_decay_keys import WeightDecayKeys


class ConfigError(ValueError):
    """A config problem a user can fix; the message names the key, the value and the rule."""


def require(ok: bool, message: str) -> None:
    """Raise ConfigError(message) unless ok: how every config rule is stated."""
    if not ok:
        raise ConfigError(message)


@dataclass
class ModelConfig(AttentionVariantKeys, InitKeys, MTPKeys, MLAKeys, MoEKeys):
    """[model]: the dense keys here, the mixture-of-experts ones in MoEKeys, multi-latent attention's in MLAKeys,
    multi-token prediction's in MTPKeys, sliding windows, sinks and the gated MLP's clamp in AttentionVariantKeys."""

    num_layers: int = 2
    """Transformer blocks."""
    hidden_size: int = 64
    num_attention_heads: int = 4
    group_query_attention: bool = False
    """Grouped-query attention: num_query_groups key/value heads, each shared by
    num_attention_heads / num_query_groups query heads (else one per query head)."""
    num_query_groups: int = 1
    kv_channels: int = 0
    """Channels per attention head; 0 means hidden_size / num_attention_heads."""
    ffn_hidden_size: int = 0
    """MLP width; 0 means 4 * hidden_size (with swiglu: 8/3 * hidden_size rounded down to a
    multiple of 64, as Megatron)."""
    swiglu: bool = False
    """A SwiGLU MLP, fc2(silu(gate(x)) * fc1(x)), instead of fc2(gelu(fc1(x)))."""
    squared_relu: bool = False
    """Megatron's --squared-relu: fc2(relu(fc1(x))^2) instead of the GeLU (dense MLPs)."""
    openai_gelu: bool = False
    bias_gelu_fusion: bool = True
    """Megatron's GeLU variant: the tanh approximation with bias_gelu_fusion (when the linears
    have biases) or openai_gelu, else the exact erf GeLU."""
    add_bias_linear: bool = True
    """Biases in every linear layer (GPT-3); False gives Llama's bias-free layers."""
    add_qkv_bias: bool = False
    """A bias in the QKV projection even without add_bias_linear."""
    qk_layernorm: bool = False
    """Normalise each query and key head (model.normalization over the head channels)."""
    apply_layernorm_1p: bool = False
    """Norm weights stored as gamma - 1 (start at zero; the weight decay pulls gamma towards 1)."""
    seq_length: int = 128
    max_position_embeddings: int = 0
    """Rows of the learned position table; 0 means seq_length."""
    init_method_std: float = 0.02
    position_embedding_type: str = "learned_absolute"
    """'learned_absolute' (GPT-3) or 'rope'."""
    rotary_base: int = 10000
    rotary_interleaved: bool = False
    """RoPE rotates channel pairs (2i, 2i+1) if set, else (i, i + d/2) (Megatron's default)."""
    rotary_percent: float = 1.0
    """The fraction of each head's channels RoPE rotates (the first ones)."""
    use_rope_scaling: bool = False
    """Llama 3.1's RoPE frequency scaling (original context 8192, low/high frequency factors 1/4)."""
    rope_scaling_factor: float = 8.0
    normalization: str = "LayerNorm"
    """'LayerNorm' (GPT-3) or 'RMSNorm'."""
    norm_epsilon: float = 1e-5
    untie_embeddings_and_output_weights: bool = False
    make_vocab_size_divisible_by: int = 128
    """The vocabulary is padded to a multiple of this alone (never times tp), so the model is mesh-free."""
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    dropout_rng: str = "megatron"
    """How dropout masks are drawn: 'megatron' (per-rank generator streams, Megatron's semantics:
    the masks depend on the layout) or 'layout_invariant' (each mask element a hash of what it
    drops, the same in every layout: dtgpt/parallel/invariant_dropout.py)."""

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        return int(8 * self.hidden_size / 3 / 64) * 64 if self.swiglu else 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        """Key/value heads: num_query_groups under grouped-query attention, else one per head."""
        return self.num_query_groups if self.group_query_attention else self.num_attention_heads

    @property
    def qkv_bias(self) -> bool:
        return self.add_bias_linear or self.add_qkv_bias

    @property
    def gelu_approximation(self) -> str:
        """F.gelu's `approximate` for Megatron's GeLU variant (see bias_gelu_fusion)."""
        tanh = self.openai_gelu or (self.bias_gelu_fusion and self.add_bias_linear)
        return "tanh" if tanh else "none"

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    @property
    def expert_ffn_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_size


@dataclass
class TrainingConfig:
    micro_batch_size: int = 1
    global_batch_size: int = 8
    rampup_batch_size: list[int] = field(default_factory=list)
    """[start, increment, ramp_samples]; empty means no ramp-up."""
    step_batch_size_schedule: str = ""
    """Megatron's step schedule "THRESHOLD:BS ...": the global batch is BS from THRESHOLD tokens
    consumed (suffixes K, M, B, T = 1e3 ... 1e12; the first threshold 0). Needs train_samples;
    global_batch_size is its last BS (docs/schedules.md)."""
    train_iters: int = 100
    train_samples: Optional[int] = None
    """Sample-based training: stop once this many samples are consumed (train_iters is then
    derived, as Megatron derives it, and may not be set too)."""
    calculate_per_token_loss: bool = True
    """The loss is the sum of token losses over the global batch's loss tokens (true), or
    Megatron's default (false): the mean of each micro-batch's per-token mean (docs/schedules.md)."""
    seed: int = 1234
    fp16: bool = False
    bf16: bool = False
    """fp16 / bf16: the model computes in that dtype (parameters gathered, activations, every
    tensor- and pipeline-parallel collective) over fp32 master weights and Adam state, as Megatron
    does (dtgpt/parallel/fsdp.py)."""
    accumulate_allreduce_grads_in_fp32: bool = False
    """Accumulate gradients over micro-batches and reduce them over dp in fp32 (else in the
    compute dtype). Always on under bf16 unless grad_reduce_in_bf16, as in Megatron."""
    grad_reduce_in_bf16: bool = False
    """Under bf16: accumulate gradients and reduce them over dp in bf16 instead of fp32 (master
    weights and Adam state stay fp32), Megatron's --grad-reduce-in-bf16."""
    fp32_residual_connection: bool = False
    """Keep the residual stream (and what pipeline stages pass) in fp32 under fp16 / bf16."""
    fp16_lm_cross_entropy: bool = False
    """Compute the loss from fp16 / bf16 logits instead of casting them to fp32 first."""
    recompute_granularity: Optional[str] = None
    """Megatron's activation recomputation: 'selective' (recompute_modules of every block) or
    'full' (whole blocks, chosen by recompute_method); unset: none."""
    recompute_method: Optional[str] = None
    """With 'full': 'uniform' (every block, in groups of recompute_num_layers recomputed as one
    unit) or 'block' (the first recompute_num_layers blocks of each pipeline stage)."""
    recompute_num_layers: Optional[int] = None
    """With 'full': blocks per recomputed group ('uniform') or recomputed per stage ('block')."""
    recompute_modules: Optional[list[str]] = None
    """With 'selective': the submodules of every block that backward recomputes (Megatron's
    names; unset: ['core_attn']): core_attn, mlp, moe, shared_experts, layernorm, mla_up_proj,
    moe_act (dtgpt/parallel/recompute_modules.py says what each keeps)."""
    moe_layer_recompute: bool = False
    """Megatron's older flag: the same as recompute_granularity='selective' with 'moe' added to recompute_modules."""
    compile: bool = False
    """torch.compile the whole model (per stage under pipeline parallelism)."""
    device: str = "auto"
    """'auto' (CUDA when present, else CPU), 'cpu' or 'cuda'."""
    nan_policy: str = "skip"
    """What a non-finite loss does: 'skip' the iteration or 'stop' the run."""
    iterations_to_skip: list[int] = field(default_factory=list)
    """Megatron's --iterations-to-skip: these iterations (1-based) read their batch and count it as
    consumed, but take no forward, backward or update (the LR schedule does not move)."""
    exit_skipped_iters: int = 100
    """Stop with an error after this many skipped iterations in a row (0: never)."""
    check_weight_hash_across_dp_replicas_interval: int = 0
    """Every this many iterations the dp_replicate replicas compare a hash of their weights and
    stop the run if they differ (Megatron's check; 0: never; dtgpt/parallel/replica_check.py)."""
    deterministic: bool = False
    """Megatron's --deterministic-mode: on CUDA, deterministic kernels only (an op without one
    raises), cuBLAS's fixed workspace and NCCL's ring algorithm (dtgpt/determinism.py)."""


@dataclass
class OptimizerConfig(MuonKeys, WeightDecayKeys):
    lr: float = 3e-4
    min_lr: float = 0.0
    decoupled_lr: Optional[float] = None
    """Peak LR of the word embedding and the output layer (Megatron's --decoupled-lr), on the
    same schedule as lr; unset: they follow lr (dtgpt/decoupled_lr.py)."""
    decoupled_min_lr: Optional[float] = None
    """Their minimum LR under decoupled_lr; unset: min_lr."""
    lr_decay_style: str = "linear"
    """'constant', 'linear', 'cosine', 'inverse-square-root' or 'WSD'."""
    lr_decay_iters: Optional[int] = None
    """Decay length in iterations (times global_batch_size in samples); default train_iters."""
    lr_decay_samples: Optional[int] = None
    lr_warmup_fraction: Optional[float] = None
    """Warmup as a fraction of the decay length. At most one of lr_warmup_fraction, lr_warmup_iters
    and lr_warmup_samples is set (a command-line one replaces the file's: config/precedence.py)."""
    lr_warmup_iters: int = 0
    lr_warmup_samples: int = 0
    lr_warmup_init: float = 0.0
    lr_wsd_decay_style: str = "exponential"
    """Anneal of WSD: 'linear', 'cosine', 'exponential' or 'minus_sqrt'."""
    lr_wsd_decay_iters: Optional[int] = None
    lr_wsd_decay_samples: Optional[int] = None
    override_opt_param_scheduler: bool = False
    """On resume, follow this config's LR schedule whatever the checkpoint's was."""
    use_checkpoint_opt_param_scheduler: bool = False
    """On resume, take lr, min_lr, warmup, decay length and style from the checkpoint. With
    neither key, they must agree with the checkpoint's (as Megatron asserts)."""
    optimizer: str = "adam"
    """Megatron's --optimizer: 'adam' (torch AdamW), 'sgd' (torch SGD with sgd_momentum, weight decay
    added to the gradient) or 'muon' / 'dist_muon' (the muon_* keys): dtgpt.optim.build_optimizer."""
    sgd_momentum: float = 0.9
    """Momentum of 'sgd' (Megatron's --sgd-momentum); 0 keeps no momentum buffer."""
    weight_decay: float = 0.01
    """The decoupled weight decay of the matrices (Megatron's --weight-decay); a 'linear' or
    'cosine' weight_decay_incr_style replaces it with its schedule (WeightDecayKeys)."""
    apply_wd_to_qk_layernorm: bool = False
    """Decay the query and key norms' weights too (Megatron's --apply-wd-to-qk-layernorm; other
    biases and norm weights never decay): dtgpt.optim.decays."""
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
class ParallelConfig(PipelineSplitKeys):
    """[parallel]: the mesh and schedule here, Megatron's uneven pipeline split in PipelineSplitKeys."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    data_parallel_shard_size: int = -1
    """FSDP shard degree; -1 means whatever the world size leaves."""
    data_parallel_replicate_size: int = 1
    """HSDP replica count; > 1 replicates the FSDP shards."""
    context_parallel_size: int = 1
    """Ranks that split each sequence (Megatron's --context-parallel-size): each holds 2 of its
    2*cp chunks, attends over keys and values gathered from the others (dtgpt/parallel/context.py)."""
    sequence_parallel: bool = False
    pipeline_schedule: str = "1F1B"
    virtual_pipeline_stages_per_rank: int = 1
    pipeline_layers_per_stage: list[int] = field(default_factory=list)
    """Explicit layer count per stage (pp * virtual entries); empty means an even split, or
    Megatron's split where its keys are set (PipelineSplitKeys)."""
    loss_parallel: bool = True
    """Under tp, cross-entropy on vocabulary-sharded logits (no full-logit gather): Megatron's
    vocabulary-parallel loss (dtgpt/parallel/vocab_parallel_loss.py). False: the logits are
    gathered whole and the one-process loss runs on them."""
    expert_model_parallel_size: int = 1
    """Ranks that split each MoE layer's experts, folded out of data_parallel_shard_size *
    context_parallel_size (Megatron's; expert tensor parallelism is 1)."""
    expert_tensor_parallel_size: Optional[int] = None
    """Megatron's tp split of each expert: only 1 is built (experts are kept whole on every tp
    rank; unset means the same), docs/moe.md."""
    fsdp_reshard_after_forward: str = "never"
    """'never' (= 'default', Megatron's distributed optimizer: each FSDP unit is all-gathered once
    per iteration and kept through every micro-batch) or 'always' (ZeRO-3: re-gathered in each
    micro-batch's forward and backward; less memory, 2 x micro-batches x the all-gathers)."""


@dataclass
class DataConfig(TokenizerKeys):
    """[data]: the data keys here, the tokenizer's in TokenizerKeys."""

    data_path: list[str] = field(default_factory=list)
    """Megatron's blend list: ["0.3", "prefA", "0.7", "prefB"]; a bare prefix has weight 1."""
    train_data_path: list[str] = field(default_factory=list)
    valid_data_path: list[str] = field(default_factory=list)
    test_data_path: list[str] = field(default_factory=list)
    split: str = "969,30,1"
    order: str = "megatron"
    """'megatron': sample i is Megatron's sample i (the order depends on the samples asked for);
    'stable': epochs shuffled one by one, so asking for more samples only appends (docs/data.md)."""
    mock_data: bool = False
    """Megatron's MockGPTDataset: documents 1, 2, ..., n-1 (mod the vocabulary) then eod, of
    lengths drawn with seed 0, ordered as GPTDataset orders any data (docs/data.md)."""
    eod_mask_loss: bool = False
    """No loss where the input token is the eod (Megatron's --eod-mask-loss)."""
    reset_position_ids: bool = False
    """Positions restart at 0 after each eod (Megatron's --reset-position-ids)."""
    reset_attention_mask: bool = False
    """A token attends only to earlier tokens of its own document; the eod ends its document
    (Megatron's --reset-attention-mask)."""
    builtin_corpus: str = ""
    """'python-docstrings': text gathered from the installed standard library, no download."""
    data_cache_path: str = ""
    """Where index arrays (and the built-in corpus) are cached; default next to the data."""
    num_workers: int = 2


@dataclass
class CheckpointConfig(CheckpointKeys):
    """[checkpoint]: saving and loading here; what a save keeps and the exit signal in CheckpointKeys."""

    save: str = ""
    load: str = ""
    load_iteration: int = 0
    """Load this iteration instead of the one latest_checkpointed_iteration.txt names."""
    load_optimizer: bool = True
    """False (Megatron's --no-load-optim): optimizer state, LR schedule and loss scale start fresh;
    weights, progress and RNG are loaded."""
    save_optimizer: bool = True
    """False (Megatron's --no-save-optim): checkpoints hold no optimizer state, LR schedule or loss
    scale; a resume from one starts them fresh, as checkpoint.load_optimizer=false does."""
    load_rng: bool = True
    """False (--no-load-rng): the generators keep their fresh seeding instead of the checkpoint's."""
    finetune: bool = False
    """Load the weights only (Megatron's --finetune): iteration, consumed samples, optimizer, LR
    schedule, loss scale and RNG start fresh."""
    use_checkpoint_args: bool = False
    """Take the model's architecture from the checkpoint to load (its saved config, or a
    Megatron-LM checkpoint's args) instead of [model]; from a Megatron checkpoint also
    data.tokenizer_type, data.tokenizer_model and data.tiktoken_pattern, as Megatron takes them."""
    use_tokenizer_model_from_checkpoint_args: bool = True
    """False (Megatron's --no-use-tokenizer-model-from-checkpoint-args): use_checkpoint_args keeps the
    config's data.tokenizer_type and data.tokenizer_model."""
    auto_resume: bool = False
    save_interval: int = 0
    async_save: bool = False
    keep_last: int = 0
    """Keep this many newest iterations (0 keeps all). Nothing is pruned after a save whose
    weights are not finite."""
    save_retain_interval: int = 0
    """Megatron's --save-retain-interval: after each save, the previous checkpoint is deleted
    unless its iteration is a multiple of this (0: none deleted); the newest always stays."""
    overwrite: bool = False
    """Let a run that did not load from checkpoint.save write into it although it holds
    iter_* directories (of another run, which this one may then replace)."""
    trust_pickles: bool = False
    """Unpickle checkpoint metadata and non-tensor items without the allowlist (a checkpoint
    you trust, e.g. another tool's); warned. See docs/checkpoints.md."""
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
    logging_level: Optional[int] = None
    """The level of Python's root logger (Megatron's --logging-level, e.g. 40 = ERROR); unset: Python's."""
    log_progress: bool = False
    """Megatron's --log-progress: append job starts, saves and deletions, with throughput and
    tokens, to progress.txt in checkpoint.save (dtgpt/progress_log.py)."""


@dataclass
class EvalConfig:
    eval_interval: int = 1000
    eval_iters: int = 10
    skip_train: bool = False
    """Megatron's --skip-train: no training and no save; evaluate eval_iters batches of validation and
    of test, each from its first sample, at the loaded iteration, then exit."""


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

