"""Every option of Megatron-LM's argument parser, as data: the flags train.py recognises as Megatron's.

Read from Megatron-LM core_v0.16.1's own parser (megatron/training/arguments.py,
add_megatron_arguments: each action's option strings, dest, action and nargs), plus the flags
newer releases added that dtgpt maps (NEWER_FLAGS). One entry per option string, without the
leading dashes; its suffix says how argparse reads it:

    name        one value          name!   store_true (no value)     name*  one or more values
    name:3      exactly 3 values   name~   store_false (no value)    =dest  where the value lands,
                                                                            when not the name's own
"""

MEGATRON_0_16_FLAGS = """
    tensor-model-parallel-size pipeline-model-parallel-comm-backend pipeline-model-parallel-size
    sequence-parallel! context-parallel-size hierarchical-context-parallel-sizes*
    max-seqlen-per-dp-cp-rank hybrid-context-parallel! expert-model-parallel-size
    expert-tensor-parallel-size moe-extended-tp! no-initialization~=perform_initialization
    use-cpu-initialization! fp16! bf16! deterministic-mode!
    no-async-tensor-model-parallel-allreduce~=async_tensor_model_parallel_allreduce
    disable-async-tensor-model-parallel-allreduce~=async_tensor_model_parallel_allreduce
    tp-comm-overlap! no-tp-comm-bulk-wgrad~=tp_comm_bulk_wgrad
    disable-tp-comm-bulk-wgrad~=tp_comm_bulk_wgrad no-tp-comm-bulk-dgrad~=tp_comm_bulk_dgrad
    disable-tp-comm-bulk-dgrad~=tp_comm_bulk_dgrad no-tp-comm-overlap-ag~=tp_comm_overlap_ag
    disable-tp-comm-overlap-ag~=tp_comm_overlap_ag no-tp-comm-overlap-rs~=tp_comm_overlap_rs
    disable-tp-comm-overlap-rs~=tp_comm_overlap_rs tp-comm-overlap-rs-dgrad!
    no-tp-comm-split-ag~=tp_comm_split_ag disable-tp-comm-split-ag~=tp_comm_split_ag
    no-tp-comm-split-rs~=tp_comm_split_rs disable-tp-comm-split-rs~=tp_comm_split_rs
    cross-entropy-loss-fusion! cross-entropy-fusion-impl tp-comm-bootstrap-backend
    overlap-moe-expert-parallel-comm! delay-wgrad-compute! ep-overlap-early-attn-memory-release!
    use-ring-exchange-p2p! defer-embedding-wgrad-compute! wgrad-deferral-limit
    overlap-p2p-communication-warmup-flush!=overlap_p2p_comm_warmup_flush
    microbatch-group-size-per-virtual-pipeline-stage=microbatch_group_size_per_vp_stage
    mtp-standalone! cpu-offloading-num-layers num-layers mtp-num-layers mtp-loss-scaling-factor
    account-for-embedding-in-pipeline-split! account-for-loss-in-pipeline-split! hidden-size
    num-attention-heads attention-backend softmax-type num-query-groups ffn-hidden-size kv-channels
    hidden-dropout attention-dropout fp32-residual-connection!
    apply-residual-connection-post-layernorm! norm-epsilon=layernorm_epsilon
    apply-layernorm-1p!=layernorm_zero_centered_gamma disable-bias-linear~=add_bias_linear
    add-qkv-bias! glu-linear-offset activation-func-clamp-value rotary-interleaved! normalization
    qk-layernorm! qk-l2-norm! qk-clip! qk-clip-alpha qk-clip-threshold attention-output-gate!
    calculate-per-token-loss! multi-latent-attention! experimental-attention-variant
    dsa-indexer-n-heads dsa-indexer-head-dim dsa-indexer-topk dsa-indexer-loss-coeff
    dsa-indexer-use-sparse-loss! linear-conv-kernel-dim linear-key-head-dim linear-value-head-dim
    linear-num-key-heads linear-num-value-heads init-method-std embedding-init-method-std
    init-model-with-meta-device! apply-query-key-layer-scaling!
    disable-bf16-reduced-precision-matmul! use-fused-weighted-squared-relu! recompute-granularity
    recompute-method recompute-num-layers distribute-saved-activations! recompute-modules*
    fp8-format=fp8 fp8-recipe fp8-quantizer-factory fp8-margin fp8-interval fp8-amax-history-len
    fp8-amax-compute-algo no-fp8-wgrad~=fp8_wgrad disable-fp8-wgrad~=fp8_wgrad
    first-last-layers-bf16! num-layers-at-start-in-bf16 num-layers-at-end-in-bf16
    use-kitchen-attention! kitchen-attention-backend fp4-format=fp4 fp4-recipe
    fp4-param-gather!=fp4_param fp4-quantizer-factory moe-shared-expert-intermediate-size
    moe-shared-expert-gate! moe-shared-expert-overlap! moe-ffn-hidden-size moe-router-topk
    moe-enable-routing-replay! moe-router-padding-for-quantization! moe-router-padding-for-fp8!
    moe-router-num-groups moe-router-group-topk moe-router-pre-softmax!
    moe-router-topk-scaling-factor moe-router-score-function moe-router-dtype
    moe-router-enable-expert-bias! moe-router-bias-update-rate moe-router-force-load-balancing!
    moe-grouped-gemm! moe-use-legacy-grouped-gemm! moe-z-loss-coeff moe-input-jitter-eps
    moe-token-dispatcher-type moe-enable-deepep! moe-flex-dispatcher-backend moe-per-layer-logging!
    moe-expert-capacity-factor moe-pad-expert-input-to-capacity! moe-token-drop-policy
    moe-layer-recompute! moe-permute-fusion! moe-router-fusion! moe-apply-probs-on-input!
    moe-latent-size moe-deepep-num-sms moe-hybridep-num-sms enable-cuda-graph!
    cuda-graph-warmup-steps external-cuda-graph! cuda-graph-impl
    no-clone-scatter-output-in-embedding~=clone_scatter_output_in_embedding
    disable-clone-scatter-output-in-embedding~=clone_scatter_output_in_embedding config-logger-dir
    flash-decode! batch-invariant-mode! use-te-activation-func! symmetric-ar-type
    inference-fuse-tp-communication! mrope-section* is-hybrid-model! mamba-state-dim mamba-head-dim
    mamba-num-groups mamba-num-heads disable-mamba-mem-eff-path~=use_mamba_mem_eff_path
    mlp-chunks-for-prefill transformer-impl fine-grained-activation-offloading! offload-modules*
    min-offloaded-tensor-size encoder-num-layers decoder-num-layers group-query-attention!
    window-size window-attn-skip-freq max-position-embeddings position-embedding-type
    relative-attention-num-buckets relative-attention-max-distance use-rotary-position-embeddings!
    rotary-base rotary-percent rotary-seq-len-interpolation-factor use-rope-scaling!
    rope-scaling-factor no-rope-freq no-position-embedding~=add_position_embedding
    make-vocab-size-divisible-by openai-gelu! squared-relu! swiglu! quick-geglu! onnx-safe
    bert-no-binary-head~=bert_binary_head untie-embeddings-and-output-weights! weight-decay
    apply-wd-to-qk-layernorm! clip-grad adam-beta1 adam-beta2 adam-eps sgd-momentum muon-momentum
    muon-no-split-qkv~=muon_split_qkv muon-use-nesterov! muon-scale-mode muon-fp32-matmul-prec
    muon-num-ns-steps muon-tp-mode muon-extra-scale-factor no-weight-decay-cond-type profile!
    profile-step-start profile-step-end use-pytorch-profiler! profile-ranks* record-memory-history!
    memory-snapshot-path micro-batch-size global-batch-size rampup-batch-size:3
    decrease-batch-size-if-needed! empty-unused-memory-level
    check-weight-hash-across-dp-replicas-interval train-sync-interval train-iters train-samples
    exit-interval exit-duration-in-mins exit-signal-handler! exit-signal
    exit-signal-handler-for-dataloader! manual-gc! manual-gc-interval
    no-manual-gc-eval~=manual_gc_eval disable-manual-gc-eval~=manual_gc_eval iterations-to-skip*
    batch-size recompute-activations!
    no-check-for-nan-in-loss-and-grad~=check_for_nan_in_loss_and_grad check-for-large-grads!
    result-rejected-tracker-filename disable-gloo-process-groups~=enable_gloo_process_groups
    tp-comm-overlap-cfg checkpoint-activations! no-masked-softmax-fusion~=masked_softmax_fusion
    no-bias-gelu-fusion~=bias_gelu_fusion no-bias-swiglu-fusion~=bias_swiglu_fusion
    no-bias-dropout-fusion~=bias_dropout_fusion no-rope-fusion~=apply_rope_fusion rope-type
    use-flash-attn! optimizer optimizer-cpu-offload! optimizer-offload-fraction
    use-torch-optimizer-for-cpu-offload! overlap-cpu-optimizer-d2h-h2d!
    dump-param-to-param-group-map no-pin-cpu-grads~=pin_cpu_grads no-pin-cpu-params~=pin_cpu_params
    dataloader-type no-persist-layer-norm!
    no-gradient-accumulation-fusion~=gradient_accumulation_fusion
    use-mcore-models!=deprecated_use_mcore_models use-legacy-models! high-priority-stream-groups*
    disable-jit-fuser! perform-rl-step! rl-prompts-per-eval grpo-prompts-per-step grpo-group-size
    grpo-iterations grpo-clamp-eps-lower grpo-clamp-eps-upper grpo-kl-beta grpo-entropy-term-weight
    grpo-filter-groups-with-same-reward! langrl-inference-server-type
    langrl-inference-server-conversation-template langrl-external-server!
    no-langrl-external-server~=langrl_external_server langrl-env-config rl-default-temperature
    rl-default-top-p rl-default-top-k rl-offload-optimizer-during-inference!
    rl-offload-kv-cache-during-training!
    no-rl-offload-kv-cache-during-training~=rl_offload_kv_cache_during_training
    rl-remove-kv-cache-during-training!
    no-rl-remove-kv-cache-during-training~=rl_remove_kv_cache_during_training rl-reset-cuda-graphs!
    no-rl-reset-cuda-graphs~=rl_reset_cuda_graphs rl-partial-rollouts!
    no-rl-partial-rollouts~=rl_partial_rollouts rl-inference-logprobs-is-correction!
    no-rl-inference-logprobs-is-correction~=rl_inference_logprobs_is_correction
    rl-importance-sampling-truncation-coef rl-use-sequence-packing!
    no-rl-use-sequence-packing~=rl_use_sequence_packing rl-sequence-packing-max-sequences-per-bin
    rl-sequence-packing-algo rl-training-cuda-graphs!
    no-rl-training-cuda-graphs~=rl_training_cuda_graphs rl-inference-tensor-model-parallel-size
    rl-inference-pipeline-model-parallel-size rl-inference-expert-model-parallel-size
    rl-inference-expert-tensor-model-parallel-size rl-inference-model-unified-memory-level
    rl-offload-inference-model-weights-when-idle!
    no-rl-offload-inference-model-weights-when-idle~=rl_offload_inference_model_weights_when_idle
    refit-method rl-verify-model-weights-swap!
    no-rl-verify-model-weights-swap~=rl_verify_model_weights_swap rl-parallel-generation-tasks
    rl-skip-bos-token! no-rl-skip-bos-token~=rl_skip_bos_token seed te-rng-tracker!
    inference-rng-tracker! data-parallel-random-init! init-method-xavier-uniform! lr-decay-style
    lr-wsd-decay-style lr-decay-iters lr-decay-samples lr-wsd-decay-iters lr-wsd-decay-samples
    lr-warmup-fraction lr-warmup-iters lr-warmup-samples lr-warmup-init
    override-opt_param-scheduler! override-opt-param-scheduler! use-checkpoint-opt_param-scheduler!
    use-checkpoint-opt-param-scheduler! start-weight-decay end-weight-decay weight-decay-incr-style
    lr warmup min-lr decoupled-lr decoupled-min-lr save save-interval
    persistent-save-interval=save_interval save-wgrads-interval save-dgrads-interval
    save-retain-interval load load-main-params-from-ckpt! non-persistent-save-interval
    non-persistent-ckpt-type non-persistent-global-ckpt-dir non-persistent-local-ckpt-dir
    non-persistent-local-ckpt-algo finetune! pretrained-checkpoint ckpt-step use-checkpoint-args!
    use-mp-args-from-checkpoint-args!
    no-use-tokenizer-model-from-checkpoint-args~=use_tokenizer_model_from_checkpoint_args
    disable-use-tokenizer-model-from-checkpoint-args~=use_tokenizer_model_from_checkpoint_args
    exit-on-missing-checkpoint! ckpt-format auto-detect-ckpt-format! ckpt-convert-format
    ckpt-convert-save ckpt-convert-update-legacy-dist-opt-format!
    no-ckpt-fully-parallel-save~=ckpt_fully_parallel_save
    disable-ckpt-fully-parallel-save~=ckpt_fully_parallel_save async-save!
    use-persistent-ckpt-worker! ckpt-fully-parallel-load! ckpt-assume-constant-structure!
    no-strict-fsdp-dtensor-load~=strict_fsdp_dtensor_load
    disable-strict-fsdp-dtensor-load~=strict_fsdp_dtensor_load dist-ckpt-strictness
    dist-ckpt-save-pre-mcore-014! dist-ckpt-optim-fully-reshardable!
    distrib-optim-fully-reshardable-mem-efficient! replication! replication-jump replication-factor
    no-save-optim! no-save-rng! no-load-optim! no-load-rng! use-dist-ckpt!=use_dist_ckpt_deprecated
    dist-ckpt-format=dist_ckpt_format_deprecated
    ckpt-fully-parallel-save!=ckpt_fully_parallel_save_deprecated grad-reduce-in-bf16! loss-scale
    initial-loss-scale min-loss-scale loss-scale-window hysteresis attention-softmax-in-fp32!
    accumulate-allreduce-grads-in-fp32! fp16-lm-cross-entropy! reuse-grad-buf-for-mxfp8-param-ag!
    decoder-first-pipeline-num-layers decoder-last-pipeline-num-layers
    pipeline-model-parallel-layout model-parallel-size num-layers-per-virtual-pipeline-stage
    num-virtual-stages-per-pipeline-rank no-overlap-p2p-communication~=overlap_p2p_comm
    distributed-backend distributed-timeout-minutes distributed-timeout-seconds-after-init
    overlap-grad-reduce! no-align-grad-reduce~=align_grad_reduce ddp-num-buckets ddp-bucket-size
    ddp-pad-buckets-for-high-nccl-busbw! ddp-reduce-scatter-with-fp32-accumulation!
    ddp-average-in-collective! overlap-param-gather! overlap-param-gather-with-optimizer-step!
    no-align-param-gather~=align_param_gather
    no-scatter-gather-tensors-in-pipeline~=scatter_gather_tensors_in_pipeline local-rank
    lazy-mpu-init use-distributed-optimizer! use-nccl-ub!=nccl_ub disable-symmetric-registration!
    fsdp-manual-registration! use-sharp! sharp-enabled-group create-all-gather-group!
    use-megatron-fsdp! data-parallel-sharding-strategy outer-dp-sharding-strategy
    no-gradient-reduce-div-fusion~=gradient_reduce_div_fusion fsdp-double-buffer!
    suggested-communication-unit-size keep-fp8-transpose-cache! enable-full-sharding-in-hsdp!
    num-distributed-optimizer-instances use-torch-fsdp2!
    torch-fsdp2-no-reshard-after-forward~=torch_fsdp2_reshard_after_forward cp-comm-type*
    nccl-communicator-config-path use-tp-pp-dp-mapping! fake-process-group! eval-iters eval-interval
    skip-train! test-mode! full-validation! multiple-validation-sets! data-path*
    phase-transition-iterations split train-data-path* valid-data-path* test-data-path*
    data-args-path per-split-data-args-path per-dataset-sequences-path dataloader-fast-cache-load!
    dataloader-defer-npy-index-mmap! data-cache-path no-mmap-bin-files~=mmap_bin_files mock-data!
    seq-length encoder-seq-length decoder-seq-length sample-rate mask-prob short-seq-prob
    num-workers reset-position-ids! reset-attention-mask! eod-mask-loss!
    no-create-attention-mask-in-dataloader~=create_attention_mask_in_dataloader
    num-dataset-builder-threads object-storage-cache-path mid-level-dataset-surplus
    allow-ambiguous-pad-tokens! fim-data! fim-rate fim-spm-rate fim-split-sample fim-fragment-rate
    fim-no-prefix fim-prefix-token fim-middle-token fim-suffix-token fim-pad-token fim-eod-token
    vocab-size padded-vocab-size vocab-file merge-file vocab-extra-ids tokenizer-type
    tokenizer-model tokenizer-metadata tokenizer-special-tokens* legacy-tokenizer! tiktoken-pattern
    tiktoken-num-special-tokens tiktoken-special-tokens* tokenizer-sentencepiece-legacy!
    tokenizer-hf-use-fast! tokenizer-hf-include-special-tokens! trust-remote-code! adlr-autoresume!
    adlr-autoresume-interval ict-head-size biencoder-projection-dim
    biencoder-shared-query-context-model! ict-load bert-load titles-data-path query-in-block-prob
    use-one-sent-docs! evidence-data-path retriever-report-topk-accuracies* retriever-score-scaling!
    block-data-path embedding-path indexer-batch-size indexer-log-interval num-classes img-h img-w
    num-channels patch-dim classes-fraction data-per-class-fraction no-data-sharding~=data_sharding
    head-lr-mult vision-pretraining! vision-pretraining-type vision-backbone-type swin-backbone-type
    mask-type mask-factor iter-per-epoch dino-local-img-size dino-local-crops-number
    dino-head-hidden-size dino-bottleneck-size dino-freeze-last-layer dino-norm-last-layer!
    dino-warmup-teacher-temp dino-teacher-temp dino-warmup-teacher-temp-epochs num-experts
    moe-layer-freq moe-use-upcycling! moe-router-load-balancing-type* moe-aux-loss-coeff*
    moe-upcycling-granularity moe-pad-experts-for-cuda-graph-inference! q-lora-rank kv-lora-rank
    qk-head-dim qk-pos-emb-head-dim v-head-dim rotary-scaling-factor mscale mscale-all-dim
    cache-mla-latents! linear-attention-freq heterogeneous-layers-config-path
    heterogeneous-layers-config-encoded-json log-interval log-params-norm! log-throughput!
    log-progress! timing-log-level timing-log-option tensorboard-dir tensorboard-log-interval
    tensorboard-queue-size log-timers-to-tensorboard!
    no-log-loss-scale-to-tensorboard~=log_loss_scale_to_tensorboard
    disable-log-loss-scale-to-tensorboard~=log_loss_scale_to_tensorboard
    log-validation-ppl-to-tensorboard! log-memory-to-tensorboard! log-memory-interval
    log-device-memory-used! log-num-zeros-in-grad! log-max-attention-logit!
    no-barrier-with-level-1-timing~=barrier_with_L1_time log-world-size-to-tensorboard!
    wandb-project wandb-exp-name wandb-save-dir wandb-entity logging-level log-energy!
    log-straggler! straggler-ctrlr-port straggler-minmax-count disable-straggler-on-startup!
    run-workload-inspector-server! inference-batch-times-seqlen-threshold max-tokens-to-oom
    output-bert-embeddings! bert-embedder-type cuda-graph-scope* use-legacy-static-engine!
    inference-max-requests=inference_max_batch_size inference-max-seq-length
    inference-max-batch-size inference-dynamic-batching! inference-dynamic-batching-buffer-size-gb
    inference-dynamic-batching-paused-buffer-size-gb inference-dynamic-batching-block-size
    inference-dynamic-batching-max-requests inference-dynamic-batching-max-tokens
    inference-dynamic-batching-num-cuda-graphs
    inference-dynamic-batching-track-paused-request-events! decode-only-cuda-graphs!
    inference-dynamic-batching-unified-memory-level nccl-all-reduce-for-prefill!
    enable-chunked-prefill~=disable_chunked_prefill disable-chunked-prefill!
    inference-dynamic-batching-cuda-graph-max-tokens
    inference-dynamic-batching-cuda-graph-mixed-prefill-count inference-logging-step-interval
    inference-wandb-logging! no-inference-wandb-logging~=inference_wandb_logging
    inference-coordinator-port fp8-param-gather! te-precision-config-file enable-experimental! spec*
    hybrid-attention-ratio hybrid-mlp-ratio hybrid-override-pattern yaml-cfg
    use-precision-aware-optimizer! main-grads-dtype main-params-dtype exp-avg-dtype exp-avg-sq-dtype
    no-one-logger~=enable_one_logger one-logger-project one-logger-run-name one-logger-async!
    app-tag-run-name app-tag-run-version inprocess-restart! inprocess-max-iterations
    inprocess-monitor-thread-interval inprocess-monitor-process-interval
    inprocess-progress-watchdog-interval inprocess-heartbeat-interval inprocess-soft-timeout
    inprocess-hard-timeout inprocess-heartbeat-timeout inprocess-barrier-timeout
    inprocess-completion-timeout inprocess-last-call-wait inprocess-termination-grace-time
    inprocess-granularity inprocess-active-world-size inprocess-empty-cuda-cache! enable-ft-package!
    calc-ft-timeouts! ft-num-warmup-iters error-injection-rate error-injection-type rerun-mode
    check-for-spiky-loss! disable-msc~=enable_msc sft! sft-tokenizer-prompt-format
"""

NEWER_FLAGS = """
    step-batch-size-schedule
    megatron-fsdp-main-grads-dtype
    megatron-fsdp-grad-comm-dtype
    muon-nesterov! muon-coefficient-type muon-scalar-optimizer
"""
