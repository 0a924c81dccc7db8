"""Context parallelism: each cp rank holds two pieces of every sequence and attends over all keys.

The sequence is cut into 2 * cp chunks and rank r keeps chunks r and 2cp-1-r (`split_sequence`).
Under a causal mask the late chunks attend to many more keys than the early ones; pairing an
early chunk with its mirror gives every rank the same amount of attention work.

Every per-token tensor of a sample (tokens, labels, positions, document ids) is computed on the
full sequence and then cut by `split_sequence`, so the model sees global positions and the loss
counts global tokens. Everything outside attention works token by token and needs nothing
more. Attention (`ContextParallelAttention`) all-gathers keys and values over the cp group and
masks with the *global* token indices: a query at global index i sees the keys j <= i (of its
own document, when document ids are given). On CUDA the same masking runs through flash
attention's varlen kernel instead, with no mask (dtgpt/attention_varlen.py).

Why an all-gather and not torch's `context_parallel`: the stock API shards buffers in place
under a context manager and needs a sharding strategy for the SDPA kernel in use, which the CPU
kernel lacks (torch 2.13), so it could not be tested against one process here. The all-gather
is a functional collective with autograd (its backward reduce-scatters the key and value
gradients) and runs on gloo and NCCL alike, so the same path runs on CUDA: the tested path is
the one that trains. Its cost: each rank holds the full sequence's keys and values of a layer
while that layer's attention runs (and for backward, unless the core is recomputed).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from dtgpt import varlen_kernel
from dtgpt.attention_sink import attend_with_sink
from dtgpt.attention_varlen import Documents, WholeRows, context_parallel_documents_attention, document_tensor
from dtgpt.model import GPT, CoreAttention, allowed_keys, attend
from dtgpt.mtp import named_blocks
from dtgpt.parallel.collectives import all_gather_autograd
from dtgpt.parallel.context_shift import ContextParallelShift


def split_sequence(tensor: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 1) -> torch.Tensor:
    """This cp rank's part of `tensor` along `dim`: chunks cp_rank and 2*cp_size-1-cp_rank of 2*cp_size
    (validation requires seq_length to divide by 2 * cp: config/parallel_rules.py)."""
    if cp_size == 1:
        return tensor
    chunks = tensor.chunk(2 * cp_size, dim)
    return torch.cat((chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]), dim)


def global_indices(local_length: int, cp_rank: int, cp_size: int, device: torch.device) -> torch.Tensor:
    """The global token indices of the local_length tokens cp rank `cp_rank` holds."""
    return split_sequence(torch.arange(local_length * cp_size, device=device), cp_rank, cp_size, dim=0)


class ContextParallelAttention(nn.Module):
    """CoreAttention over a sequence split across the cp group: gathered keys, global causal mask.

    Takes and returns what CoreAttention does, (B, nh, T_local, hd); the keys it gathers are in
    cp-rank order (each rank's two chunks in turn), and the mask follows their global indices.
    whole_rows: the bounds it runs the varlen kernel on without documents, shared by the cores of
    a model part (a core of its own where None). window: the core's sliding window (CoreAttention.window).
    """

    def __init__(self, cp_mesh: DeviceMesh, whole_rows: WholeRows | None = None, window: int | None = None):
        super().__init__()
        self.window = window
        self.cp_mesh = cp_mesh
        self.cp_rank = cp_mesh.get_local_rank()
        self.cp_size = cp_mesh.size()
        self.whole_rows = whole_rows if whole_rows is not None else WholeRows()

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """All ranks' x concatenated along dim, in cp-rank order (backward: reduce-scatter)."""
        return all_gather_autograd(x.contiguous(), gather_dim=dim, group=self.cp_mesh)

    def key_indices(self, local_length: int, device: torch.device) -> torch.Tensor:
        """The global token indices of the gathered keys, in gathered order."""
        return torch.cat([global_indices(local_length, r, self.cp_size, device) for r in range(self.cp_size)])

    def allowed(self, local_length: int, document_ids: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        """Boolean (T_local, T) or (B, 1, T_local, T): which gathered keys each local query sees."""
        q_idx = global_indices(local_length, self.cp_rank, self.cp_size, device)
        k_idx = self.key_indices(local_length, device)
        # Document ids are gathered in the order of the keys (no gradient flows through them).
        document_ids = document_tensor(document_ids)
        k_docs = self.gather(document_ids, dim=1) if document_ids is not None else None
        return allowed_keys(q_idx, k_idx, document_ids, k_docs, self.window)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids=None, token_index=None, sink=None) -> torch.Tensor:
        """As CoreAttention.forward (no dropout: token_index is unused)."""
        k_all, v_all = self.gather(k, dim=2), self.gather(v, dim=2)  # (B, nh, T, hd)
        kernel = varlen_kernel.windowed_kernel_for(q, self.window) if sink is None else None
        if kernel is not None and (document_ids is None or isinstance(document_ids, Documents)):
            bounds = document_ids.bounds if document_ids is not None else self.whole_rows(q.shape[0], k_all.shape[2], q.device)
            return context_parallel_documents_attention(kernel, q, k_all, v_all, bounds, self.cp_rank, self.cp_size, self.window)
        mask = self.allowed(q.shape[2], document_ids, q.device)
        # Every query sees at least its own key, so no row of the mask is empty.
        if sink is not None:
            return attend_with_sink(q, k_all, v_all, mask, sink)  # (B, nh, T_local, hd)
        return attend(q, k_all, v_all, mask=mask)  # (B, nh, T_local, hd)


def apply_cp(model: GPT, cp_mesh: DeviceMesh) -> None:
    """Swap every block's attention core (the prediction modules' too) for the context-parallel
    one, and their token shift for the one across cp chunks, in place (no parameters change).
    It has no attention dropout: config validation allows attention dropout with cp only with
    model.dropout_rng='layout_invariant', whose core then wraps this one."""
    if model.mtp is not None:
        model.mtp.shift = ContextParallelShift(cp_mesh)
    whole_rows = WholeRows()
    for block in named_blocks(model).values():
        if not isinstance(block.attention.core, CoreAttention):
            raise TypeError("apply_cp must run before recomputation wraps the attention core")
        block.attention.core = ContextParallelAttention(cp_mesh, whole_rows, block.attention.core.window)
