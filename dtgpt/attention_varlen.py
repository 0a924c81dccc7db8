"""Document masking without a T x T mask: attention over the documents as packed sequences.

With Megatron's reset_attention_mask a token attends only to the earlier tokens of its own
document. The masked path (dtgpt.model.CoreAttention) hands SDPA a boolean (B, 1, T, T) mask, which
on CUDA rules out flash attention and builds the mask in every layer. Here the documents are
sequences of their own for flash attention's variable-length kernel (dtgpt.varlen_kernel): where
each document starts is counted on the host when the loader builds the batch (`DocumentBounds`),
moves to the device with it, and the kernel needs no mask and no host sync (its longest-sequence
arguments are host integers). The CPU keeps the masked path: the kernel is CUDA only.

Under context parallelism (dtgpt.parallel.context) each rank holds query chunks c and 2cp-1-c of
every sequence and gathers all keys. Each document's queries in a chunk are one sequence for the
kernel, against that document's keys from its start to the chunk's end: causal masking aligned
bottom-right (the last query sees the last key) is then exactly "keys of my document at or before
me". Those keys are picked out of the gathered ones, in global order, by an index built on the
host, so the segments are contiguous as the kernel needs (a copy of the keys and values, not a mask).

Compiled blocks run these functions eagerly (a graph break): the document lengths change every
batch, and a compiled graph would specialise on the host integers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from dtgpt import varlen_kernel
from dtgpt.chunks import chunk_rows


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor's copy on `device`, queued without waiting: a copy to CUDA from pageable
    memory may wait for the stream, from pinned memory it does not (torch's pinned-memory cache
    keeps the buffer until the copy has run)."""
    if device.type == "cuda" and not host.is_pinned():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


class Derived:
    """What a DocumentBounds derives once per micro-batch, for all its layers. Not a dict: FSDP's
    input cast rebuilds dicts and dataclasses (torch.distributed.utils._apply_to_tensors) but
    passes other objects through, so every block of a micro-batch shares one."""

    def __init__(self):
        self.entries: dict = {}


@dataclass
class DocumentBounds:
    """Where the documents of some rows of seq_length tokens start, counted on the host.

    bounds (N + 1,) int32: the flat offset (row * seq_length + start) of each of the rows' N
    documents, then the end of the last row; it moves with the batch to the model's device. `host`
    holds the same numbers on the host, `row_first` (rows + 1) the index in them of each row's first
    document. Offsets count from the first row of the batch the loader built: a micro-batch cut
    from it starts at host[0]. Under context parallelism the bounds stay those of the whole
    sequences while the tokens are cut into chunks.
    """

    bounds: torch.Tensor
    host: np.ndarray
    row_first: tuple[int, ...]
    seq_length: int
    derived: Derived = field(default_factory=Derived, repr=False, compare=False)

    @classmethod
    def of(cls, document_ids: torch.Tensor) -> "DocumentBounds":
        """From the document ids (B, T) of whole sequences, on the host (dtgpt.data.batch)."""
        ids = document_ids.cpu().numpy()
        starts = np.ones(ids.shape, dtype=bool)
        starts[:, 1:] = ids[:, 1:] != ids[:, :-1]  # a row's first token always starts a document
        return cls.from_starts(np.flatnonzero(starts), *ids.shape)

    @classmethod
    def whole_rows(cls, rows: int, seq_length: int) -> "DocumentBounds":
        """Every row one document (plain causal attention)."""
        return cls.from_starts(np.arange(rows) * seq_length, rows, seq_length)

    @classmethod
    def from_starts(cls, flat_starts: np.ndarray, rows: int, seq_length: int) -> "DocumentBounds":
        host = np.append(flat_starts, rows * seq_length).astype(np.int64)
        row_first = tuple(np.searchsorted(flat_starts, np.arange(rows + 1) * seq_length).tolist())
        return cls(torch.from_numpy(host.astype(np.int32)), host, row_first, seq_length)

    @property
    def rows(self) -> int:
        return len(self.row_first) - 1

    def to(self, device: torch.device) -> "DocumentBounds":
        if self.bounds.device == device:
            return self
        return replace(self, bounds=to_device(self.bounds, device), derived=Derived())

    def chunk(self, n: int) -> list["DocumentBounds"]:
        """The bounds of n micro-batches of rows, cut as torch.chunk cuts the batch's tensors."""
        size = chunk_rows(self.rows, n)
        parts = []
        for r0 in range(0, self.rows, size):
            r1 = min(r0 + size, self.rows)
            a, b = self.row_first[r0], self.row_first[r1]
            first = tuple(i - a for i in self.row_first[r0 : r1 + 1])
            parts.append(DocumentBounds(self.bounds[a : b + 1], self.host[a : b + 1], first, self.seq_length))
        return parts

    def row_starts(self, row: int) -> np.ndarray:
        """Where row `row`'s documents start within it, then seq_length."""
        return self.host[self.row_first[row] : self.row_first[row + 1] + 1] - (self.host[0] + row * self.seq_length)

    def packed(self) -> tuple[torch.Tensor, int]:
        """(cumulative sequence bounds of the rows' documents, the longest document): the kernel's
        view of the rows flattened, (rows * seq_length, ...). Made once per micro-batch."""
        cache = self.derived.entries
        if "packed" not in cache:
            base = int(self.host[0])
            cu = self.bounds - base if base else self.bounds  # on the device: no host sync
            cache["packed"] = (cu, int(np.diff(self.host).max()))
        return cache["packed"]

    def context_parallel(self, cp_rank: int, cp_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
        """(cu_q, cu_k, key index, longest query segment, longest key segment) of cp rank cp_rank's
        chunks (see the module doc): the key index picks, out of the gathered keys flattened
        (rows * seq_length, in cp-rank order), each segment's keys in global order."""
        key, cache = ("cp", cp_rank, cp_size), self.derived.entries
        if key not in cache:
            cache[key] = self._context_parallel(cp_rank, cp_size)
        return cache[key]

    def _context_parallel(self, cp_rank: int, cp_size: int):
        T = self.seq_length
        L = T // (2 * cp_size)
        # Where global position p sits among the gathered keys: rank r holds chunks r, 2cp-1-r.
        chunk = np.arange(T) // L
        rank = np.where(chunk < cp_size, chunk, 2 * cp_size - 1 - chunk)
        gathered = (2 * rank + (chunk >= cp_size)) * L + np.arange(T) % L
        q_lens, k_lens, index = [], [], []
        for row in range(self.rows):
            starts = self.row_starts(row)
            s, e = starts[:-1], starts[1:]
            for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
                lo, hi = c * L, (c + 1) * L
                here = (s < hi) & (e > lo)  # the documents with queries in this chunk
                q_lens.append(np.minimum(e[here], hi) - np.maximum(s[here], lo))
                k_lens.append(np.minimum(e[here], hi) - s[here])
                index.append(row * T + gathered[s[here][0] : hi])
        q_lens, k_lens = np.concatenate(q_lens), np.concatenate(k_lens)
        device = self.bounds.device

        def cumulative(lengths: np.ndarray) -> torch.Tensor:
            return to_device(torch.from_numpy(np.append(0, np.cumsum(lengths)).astype(np.int32)), device)

        index_t = to_device(torch.from_numpy(np.concatenate(index)), device)
        return cumulative(q_lens), cumulative(k_lens), index_t, int(q_lens.max()), int(k_lens.max())


@dataclass
class Documents:
    """What the model's `document_ids` keyword holds when the batch knows its documents' bounds:
    the ids (B, T) the masked path reads, and the bounds the varlen kernel reads."""

    ids: torch.Tensor
    bounds: DocumentBounds


def document_tensor(document_ids: torch.Tensor | Documents | None) -> torch.Tensor | None:
    """The ids (B, T) of either form of the `document_ids` keyword (None: no documents)."""
    return document_ids.ids if isinstance(document_ids, Documents) else document_ids


def tokens_major(x: torch.Tensor) -> torch.Tensor:
    """(B, heads, T, d) -> (B * T, heads, d), the kernel's packed layout (a view where x is a
    head-major view of token-major activations, as attention's q, k and v are)."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


class WholeRows:
    """Plain causal attention as one document per row, for the varlen kernel: the bounds of a
    micro-batch shape, made on first use and kept. One may be shared by the cores of a model part
    (dtgpt.parallel.context.apply_cp hands each cp core the same), so what the bounds derive
    (under cp the key index and sequence bounds of this rank's chunks, built on the host and
    copied to the device: DocumentBounds.context_parallel) is made once per shape, not once per
    layer. The bounds depend on the shape alone, the same for every layer and micro-batch."""

    def __init__(self):
        self.by_shape: dict[tuple, DocumentBounds] = {}

    def __call__(self, rows: int, seq_length: int, device: torch.device) -> DocumentBounds:
        key = (rows, seq_length, device)
        if key not in self.by_shape:
            self.by_shape[key] = DocumentBounds.whole_rows(rows, seq_length).to(device)
        return self.by_shape[key]


@torch.compiler.disable
def documents_attention(
    kernel: varlen_kernel.Kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: DocumentBounds, window: int | None = None
) -> torch.Tensor:
    """Causal attention within each document (a window: the last window + 1 keys of it at most):
    q (B, nh, T, d), k, v (B, ng, T, d or dv) -> (B, nh, T, dv)."""
    B, nh, T, _ = q.shape
    cu, longest = bounds.packed()
    out = varlen_kernel.causal_varlen(kernel, tokens_major(q), tokens_major(k), tokens_major(v), cu, cu, longest, longest, window)
    return out.view(B, T, nh, -1).transpose(1, 2)


@torch.compiler.disable
def context_parallel_documents_attention(
    kernel: varlen_kernel.Kernel, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, bounds: DocumentBounds,
    cp_rank: int, cp_size: int, window: int | None = None,
) -> torch.Tensor:
    """q (B, nh, T_local, d) of this cp rank's chunks over the gathered k_all, v_all (B, ng, T, ...)
    in cp-rank order -> (B, nh, T_local, dv): causal within each document, by global position
    (a window counts back in global positions too: each segment's keys are contiguous in them)."""
    B, nh, local, _ = q.shape
    cu_q, cu_k, index, max_q, max_k = bounds.context_parallel(cp_rank, cp_size)
    keys, values = tokens_major(k_all).index_select(0, index), tokens_major(v_all).index_select(0, index)
    out = varlen_kernel.causal_varlen(kernel, tokens_major(q), keys, values, cu_q, cu_k, max_q, max_k, window)
    return out.view(B, local, nh, -1).transpose(1, 2)
