"""Megatron's Muon (--optimizer muon): momentum orthogonalised by Newton-Schulz for the matrices,
AdamW for the rest, one optimizer object and one LR schedule.

Which parameters: megatron-core's rule, every trainable 2-D weight but the word embedding and the
output layer (`is_embedding_or_output_parameter`); the position embedding is a matrix and takes
Muon too. Biases, norm weights, the embedding and the output layer keep dtgpt's AdamW groups.

The update of one matrix W with gradient G (emerging-optimizers' OrthogonalizedOptimizer, as
megatron-core's TensorParallelMuon builds it): W -= lr * wd * W (decoupled decay); the momentum
buffer M += (1 - m) (G - M); U = G + m (M - G) under Nesterov, else M; W -= lr * scale * NS(U).
NS normalises U by its Frobenius norm and runs the Newton-Schulz polynomial on the wider
orientation. The matrices are Megatron's: with muon_split_qkv the fused QKV weight (rows [group,
(q.. | k | v), head_dim], Megatron's layout and dtgpt's) is three, every group's query rows, key
rows, value rows; SwiGLU's gate and fc1, two weights in dtgpt, are one, Megatron's linear_fc1
[gate; fc1].

An MoE layer's experts (dtgpt.moe.experts: fc1_weight (E, rows, h), fc2_weight (E, h, ffn)) are
E matrices each, megatron-core's per-expert linear_fc1 and linear_fc2 (SwiGLU's [gate; fc1] is
already one): Newton-Schulz runs batched over the expert axis, each slice normalised alone and
scaled by one expert's shape; the experts' biases keep AdamW. The router's weight (E, h) and the
shared expert's are plain matrices. Multi-latent attention's projections (linear_q_proj, or
linear_q_down_proj and linear_q_up_proj; linear_kv_down_proj, linear_kv_up_proj, linear_proj)
are plain matrices too, none split: megatron-core splits only linear_qkv.

Layouts: NS needs the whole matrix. Under FSDP each matrix has one owner among the shard ranks:
its rows travel there, the owner orthogonalises it and sends each rank its rows back, in one
all_to_all each way for all matrices (dtgpt/muon_owners.py). Over tp (alone, or on the owner)
every tp rank gathers the whole matrix and orthogonalises it: Megatron's 'duplicated' mode. The
result is the whole matrix's whatever the mesh. The momentum buffer is sharded as the parameter.
The experts are sharded whole (over ep, or by FSDP without ep) except where FSDP splits each
expert's rows (over efsdp, or efsdp x tp where tp folds in, under ep): there each expert's
matrix has an owner among those ranks, as the dense matrices do (megatron-core holds an ep rank's
experts whole on each expert-data-parallel rank and orthogonalises them all there; the owners
give the same matrices, each orthogonalised once).
"""

from __future__ import annotations

import contextlib
from itertools import chain, cycle, islice, repeat
from typing import Iterator, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from dtgpt.config.muon_keys import MuonKeys
from dtgpt.decoupled_lr import is_embedding_or_output
from dtgpt.muon_owners import expert_rows_mesh_dim, orthogonalise_owned, orthogonalise_owned_experts, shard_mesh_dim

MUON = "muon"
"""The param-group key that marks Muon's group (its matrices); the other groups step as AdamW."""

NEWTON_SCHULZ_COEFFICIENTS = {
    # (a, b, c) per step: X <- a X + (b A + c A^2) X with A = X X^T; emerging-optimizers 0.3.0's sets
    "simple": [(3.4445, -4.7750, 2.0315)],
    "quintic": [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)],
    "polar_express": [(8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184), (3.9096, -2.8234, 0.5250),
                      (3.2856, -2.4153, 0.4853), (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                      (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)],
    "cans": [(8.4703, -25.1081, 18.6293), (4.1828, -3.1087, 0.5806), (3.9619, -2.9541, 0.5630),
             (3.2866, -2.4647, 0.5074), (2.2737, -1.6447, 0.4162)],
    "aol": [(4.0098, -7.0585, 2.4635), (3.4585, -5.5479, 2.5959), (2.7573, -3.2939, 1.4254), (2.7215, -3.0494, 1.3169)],
    "deepseekv4": [(3.4445, -4.7750, 2.0315)] * 8 + [(2.0, -1.5, 0.5)] * 2,
}  # fmt: skip
REPEAT_LAST = ("polar_express", "cans", "deepseekv4")
"""Sets whose last step repeats when more steps are asked for; the others cycle."""
NORM_EPS = 1e-7


EXPERT_MATRICES = ("experts.fc1_weight", "experts.fc2_weight")
"""An MoE layer's stacked expert weights (dtgpt.moe.experts): E matrices each, one per expert."""
EXPERT_BIASES = ("experts.fc1_bias", "experts.fc2_bias")
"""Their biases, 2-D only as stacks of E vectors."""


def is_muon_matrix(name: str, param: torch.Tensor) -> bool:
    """megatron-core's rule: a 2-D weight that is neither the word embedding nor the output layer;
    each expert's weight is one (stacked: 3-D), each expert's bias is not (stacked: 2-D)."""
    if name.endswith(EXPERT_MATRICES):
        return True
    return param.ndim == 2 and not is_embedding_or_output(name) and not name.endswith(EXPERT_BIASES)


class MuonMatrices(NamedTuple):
    """How dtgpt's weights make Megatron's matrices, by id of the parameter: a QKV weight's rows of
    (queries, key, value) per query group; and SwiGLU's fc1 (key) with the gate (value) whose rows
    precede its own in Megatron's one linear_fc1 [gate; fc1], orthogonalised as that one matrix."""

    qkv_splits: dict[int, tuple[int, int, int]]
    gate_of: dict[int, nn.Parameter]


def muon_matrices(part: nn.Module) -> MuonMatrices:
    from dtgpt.mlp import MLP
    from dtgpt.model import Attention

    qkv = {id(m.qkv.weight): (m.queries_per_group * m.head_dim, m.head_dim, m.head_dim) for m in part.modules() if isinstance(m, Attention)}
    gates = {id(m.fc1.weight): m.gate.weight for m in part.modules() if isinstance(m, MLP) and m.gate is not None}
    return MuonMatrices(qkv, gates)


def coefficients(kind: str, steps: int) -> Iterator[tuple[float, float, float]]:
    sets = NEWTON_SCHULZ_COEFFICIENTS[kind]
    return islice(chain(sets, repeat(sets[-1])) if kind in REPEAT_LAST else cycle(sets), steps)


def newton_schulz(x: torch.Tensor, steps: int, kind: str) -> torch.Tensor:
    """The orthogonalisation of the fp32 matrix x (about U V^T of its SVD), or of each matrix of a
    stack x (E, rows, cols) alone. Under torch's 'medium' float32 matmul precision the iteration
    runs in bf16, as emerging-optimizers runs it."""
    transpose = x.size(-2) > x.size(-1)  # iterate on the smaller Gram matrix
    x = x.mT if transpose else x
    X = F.normalize(x, p=2, dim=(-2, -1), eps=NORM_EPS)  # each matrix by its own Frobenius norm
    if torch.get_float32_matmul_precision() == "medium":
        X = X.to(torch.bfloat16)
    add_product = torch.addmm if X.ndim == 2 else torch.baddbmm
    for a, b, c in coefficients(kind, steps):
        A = X @ X.mT
        B = add_product(A, A, A, alpha=c, beta=b)
        X = add_product(X, B, X, alpha=1.0, beta=a)
    X = X.to(torch.float32)
    return X.mT if transpose else X


def scale_factor(rows: int, cols: int, mode: str) -> float:
    if mode == "spectral":
        return max(rows, cols) ** 0.5
    if mode == "shape_scaling":
        return max(1, rows / cols) ** 0.5
    return (rows / cols) ** 0.5  # unit_rms_norm


@contextlib.contextmanager
def float32_matmul_precision(precision: str):
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


class MuonWithAdamW(torch.optim.AdamW):
    """AdamW whose MUON-marked group steps by Muon (module doc). One optimizer, so the LR schedule,
    clipping, checkpoints (state keyed by parameter: Muon's `momentum_buffer`, AdamW's moments)
    and the trainer see no difference. `muon` is the [optimizer] section (its muon_* keys)."""

    def __init__(self, groups: list[dict], *, muon: MuonKeys, matrices: MuonMatrices, **adamw):
        super().__init__(groups, **adamw)
        self.muon, self.matrices = muon, matrices
        self.gates = {id(gate) for gate in matrices.gate_of.values()}

    def __setstate__(self, state: dict) -> None:
        # torch's Adam fixes up each parameter's `step` on load; Muon's matrices keep none
        groups = state["param_groups"]
        super().__setstate__({**state, "param_groups": [g for g in groups if not g.get(MUON)]})
        self.param_groups = groups

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MuonWithAdamW.step takes no closure")
        self._muon_step()
        every = self.param_groups
        self.param_groups = [g for g in every if not g.get(MUON)]  # AdamW steps the rest
        try:
            super().step()
        finally:
            self.param_groups = every

    @torch.no_grad()
    def _muon_step(self) -> None:
        m = self.muon.muon_momentum
        for group in (g for g in self.param_groups if g.get(MUON)):
            lr, wd = group["lr"], group["weight_decay"]
            updates = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                if wd != 0.0:
                    p.add_(p, alpha=-wd * lr)
                buf.lerp_(p.grad, 1 - m)
                updates[id(p)] = p.grad.lerp(buf, m) if self.muon.muon_nesterov else buf
            units = [p for p in group["params"] if id(p) in updates and id(p) not in self.gates]  # a gate steps with its fc1
            self._step_experts([p for p in units if p.ndim == 3], updates, lr)
            units = [p for p in units if p.ndim == 2]
            stacks = [self._stack(p) for p in units]
            owned = [i for i, p in enumerate(units) if shard_mesh_dim(updates[id(p)]) is not None]
            # FSDP-sharded: each matrix orthogonalised once, by its owner (dtgpt/muon_owners.py), the
            # owners chosen among the ranks of its mesh (an MoE layer's router may have its own)
            for mesh in dict.fromkeys(updates[id(units[i])].device_mesh for i in owned):  # in one order on every rank
                on_mesh = [i for i in owned if updates[id(units[i])].device_mesh == mesh]
                local = orthogonalise_owned([[updates[id(q)] for q in stacks[i]] for i in on_mesh],
                                            lambda k, wholes, on_mesh=on_mesh: self._orthogonal_whole(units[on_mesh[k]], wholes))  # fmt: skip
                for i, orths in zip(on_mesh, local):
                    for q, orth in zip(stacks[i], orths):
                        q.to_local().add_(orth, alpha=-lr)
            for i in sorted(set(range(len(units))) - set(owned)):
                for q, orth in zip(stacks[i], self._orthogonalised(units[i], [updates[id(q)] for q in stacks[i]])):
                    q.add_(orth, alpha=-lr)

    def _stack(self, p: torch.Tensor) -> list[torch.Tensor]:
        """The parameters whose rows make p's matrix: [gate, fc1] for SwiGLU's fc1, else [p]."""
        gate = self.matrices.gate_of.get(id(p))
        return [gate, p] if gate is not None else [p]

    def _orthogonalised(self, p: torch.Tensor, updates: list[torch.Tensor]) -> list[torch.Tensor]:
        """The scaled orthogonal update of the matrix whose rows `updates` are (one parameter's, or
        [gate; fc1]'s), gathered whole on every rank (tp only: Megatron's duplicated mode), each
        piece sharded as its parameter."""
        full = [u.full_tensor() if isinstance(u, DTensor) else u for u in updates]
        return [_sharded_as(u, piece) for u, piece in zip(updates, self._orthogonal_whole(p, full))]

    def _orthogonal_whole(self, p: torch.Tensor, full: list[torch.Tensor]) -> list[torch.Tensor]:
        """The scaled orthogonal update of the whole matrix whose row blocks are `full`, split back."""
        with float32_matmul_precision(self.muon.muon_fp32_matmul_prec):
            split = self.matrices.qkv_splits.get(id(p)) if self.muon.muon_split_qkv else None
            whole = torch.cat(full) if len(full) > 1 else full[0]
            orth = self._scaled(whole) if split is None else self._split_qkv(whole, split)
        return list(torch.split(orth, [f.size(0) for f in full]))

    def _step_experts(self, stacks: list[torch.Tensor], updates: dict, lr: float) -> None:
        """MoE layers' experts, a matrix each: whole on their rank, each stack in one batched
        iteration; where FSDP splits each expert's rows, each expert by its owner among those
        ranks (dtgpt/muon_owners.py), the stacks of a mesh in one exchange (module doc)."""
        split = [p for p in stacks if expert_rows_mesh_dim(updates[id(p)]) is not None]
        for p in (p for p in stacks if expert_rows_mesh_dim(updates[id(p)]) is None):
            u = updates[id(p)]
            mine, u = (p.to_local(), u.to_local()) if isinstance(u, DTensor) else (p, u)  # whole experts: no communication
            mine.add_(self._scaled_experts(u), alpha=-lr)
        for mesh in dict.fromkeys(updates[id(p)].device_mesh for p in split):  # in one order on every rank
            on_mesh = [p for p in split if updates[id(p)].device_mesh == mesh]
            for p, orth in zip(on_mesh, orthogonalise_owned_experts([updates[id(p)] for p in on_mesh], self._scaled_experts)):
                p.to_local().add_(orth, alpha=-lr)

    def _scaled_experts(self, experts: torch.Tensor) -> torch.Tensor:
        """_scaled of each whole matrix of the stack (E, rows, cols), in Muon's matmul precision."""
        with float32_matmul_precision(self.muon.muon_fp32_matmul_prec):
            return self._scaled(experts)

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        o = self.muon
        orth = newton_schulz(x, o.muon_num_ns_steps, o.muon_coefficient_type)
        return orth * scale_factor(x.size(-2), x.size(-1), o.muon_scale_mode) * o.muon_extra_scale_factor

    def _split_qkv(self, x: torch.Tensor, split: tuple[int, int, int]) -> torch.Tensor:
        """Q, K and V rows of every query group orthogonalised as three matrices, put back in place."""
        rows, cols = x.shape
        groups = rows // sum(split)
        parts = torch.split(x.view(groups, sum(split), cols), split, dim=1)  # each (groups, rows of q/k/v, cols)
        parts = [orth.view(groups, -1, cols) for orth in self._scaled_each([part.reshape(-1, cols) for part in parts])]
        return torch.cat(parts, dim=1).view(rows, cols)

    def _scaled_each(self, matrices: list[torch.Tensor]) -> list[torch.Tensor]:
        """_scaled of each matrix, those of one shape in one batched iteration (K and V; Q too
        with a query per group): a GPU launches one iteration's kernels, not one per matrix."""
        out: list[torch.Tensor | None] = [None] * len(matrices)
        for shape in dict.fromkeys(m.shape for m in matrices):
            same = [i for i, m in enumerate(matrices) if m.shape == shape]
            orth = self._scaled(torch.stack([matrices[i] for i in same])) if len(same) > 1 else self._scaled(matrices[same[0]])[None]
            for i, o in zip(same, orth):
                out[i] = o
        return out


def _sharded_as(like: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """`whole` as `like` is laid out: itself for a plain tensor, each rank's own shard of a DTensor."""
    if not isinstance(like, DTensor):
        return whole
    mesh = like.device_mesh
    replicated = DTensor.from_local(whole.contiguous(), mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, like.placements)  # a local slice, no communication
