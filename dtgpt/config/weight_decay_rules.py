"""The rules of [optimizer]'s weight decay: its schedule (Megatron's --start-weight-decay,
--end-weight-decay, --weight-decay-incr-style) and apply_wd_to_qk_layernorm."""

from __future__ import annotations

from dtgpt.config.sections import Config
from dtgpt.config.sections import require as _require


def check_weight_decay_schedule(cfg: Config) -> None:
    """Megatron-LM's checks of the schedule (arguments.py and OptimizerParamScheduler's asserts),
    each as one line (the style's choices are validation.py's)."""
    o = cfg.optimizer
    style, start, end = o.weight_decay_incr_style, o.start_weight_decay, o.end_weight_decay
    _require(o.weight_decay >= 0, f"optimizer.weight_decay={o.weight_decay} must be >= 0")
    if style == "constant":
        for key, value in (("start_weight_decay", start), ("end_weight_decay", end)):
            _require(
                value is None,
                f"optimizer.{key}={value} is set but optimizer.weight_decay_incr_style='constant': Megatron takes a start "
                "and end weight decay only with a 'linear' or 'cosine' increment (a constant one is optimizer.weight_decay)",
            )
        return
    for key, value in (("start_weight_decay", start), ("end_weight_decay", end)):
        _require(value is not None, f"optimizer.weight_decay_incr_style={style!r} needs optimizer.{key} (unset)")
        _require(value >= 0, f"optimizer.{key}={value} must be >= 0")
    _require(
        end >= start,
        f"optimizer.end_weight_decay={end} must be >= optimizer.start_weight_decay={start}: Megatron's weight decay "
        "only increases over training",
    )


def check_apply_wd_to_qk_layernorm(cfg: Config) -> None:
    m = cfg.model
    # Megatron picks the norms by module name: with its default Transformer Engine layers the
    # multi-latent attention's query norm is fused into linear_q_up_proj and never decays, with
    # its local layers it is named q_layernorm and decays. Which one a script meant is unknown.
    _require(
        not (cfg.optimizer.apply_wd_to_qk_layernorm and m.multi_latent_attention and m.qk_layernorm),
        "optimizer.apply_wd_to_qk_layernorm=true is refused with model.multi_latent_attention=true and "
        "model.qk_layernorm=true: Megatron decays the query norm with its local layers but not with "
        "Transformer Engine's, so the run it names is not defined",
    )
