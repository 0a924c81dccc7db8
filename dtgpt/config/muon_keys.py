"""The Muon keys of [optimizer] (Megatron-LM's --optimizer muon), with Megatron's names, defaults
and meanings. A base of OptimizerConfig (dtgpt/config/sections.py), as MoEKeys is of ModelConfig;
the rules are check_muon's (dtgpt/config/muon_rules.py), the optimizer dtgpt/muon.py's."""

from __future__ import annotations

from dataclasses import dataclass

MUON_OPTIMIZERS = ("muon", "dist_muon")
"""optimizer.optimizer's names of Muon: Megatron's dist_muon is its deprecated spelling of muon
with its distributed optimizer, the same update (dtgpt shards every optimizer's state alike)."""


@dataclass
class MuonKeys:
    muon_momentum: float = 0.9
    """Muon's momentum: the buffer is an EMA of the gradient, buf += (1 - m) (grad - buf)."""
    muon_split_qkv: bool = True
    """Orthogonalise each query group's Q, K and V rows of the fused QKV weight as three matrices
    (all groups' Q together, all K, all V); false (--muon-no-split-qkv): the whole weight as one."""
    muon_nesterov: bool = False
    """Nesterov momentum: orthogonalise grad + m (buf - grad) instead of buf (Megatron's
    --muon-nesterov, core 0.16's --muon-use-nesterov)."""
    muon_scale_mode: str = "spectral"
    """The update's scale for a (rows, cols) matrix: 'spectral' sqrt(max(rows, cols)),
    'shape_scaling' sqrt(max(1, rows / cols)), 'unit_rms_norm' sqrt(rows / cols)."""
    muon_fp32_matmul_prec: str = "medium"
    """torch's float32 matmul precision during Newton-Schulz: 'medium' runs the iteration in
    bf16 (as Megatron's emerging-optimizers does), 'high' in fp32 (TF32 on CUDA)."""
    muon_coefficient_type: str = "quintic"
    """Newton-Schulz coefficients: 'simple', 'quintic', 'polar_express', 'cans', 'aol' or 'deepseekv4'."""
    muon_num_ns_steps: int = 5
    """Newton-Schulz iterations per update."""
    muon_tp_mode: str = "duplicated"
    """How Megatron orthogonalises a tensor-parallel weight: 'duplicated' and 'distributed' give
    the whole matrix's result (dtgpt always does); 'blockwise' (each shard alone) only at tp 1."""
    muon_extra_scale_factor: float = 1.0
    """A further factor on every update (0.2 matches AdamW's update RMS, Moonlight's choice)."""
    muon_scalar_optimizer: str = "adam"
    """The optimizer of what Muon does not take (embedding, output layer, biases, norms): adam."""

    @property
    def uses_muon(self) -> bool:
        return self.optimizer in MUON_OPTIMIZERS  # type: ignore[attr-defined]
