"""Per-request buffers of a true-off gate: the bookkeeping, in plain torch.

While the gate is off, each decode step runs the target alone. For every new token the
target's EAGLE-3 aux hidden states (low/mid/high layers, 3·H values) are kept with the
token, in a buffer row of the request. When drafting resumes, one batched draft extend
over the buffered tokens writes the draft KV the off steps skipped.

EAGLE's shift: the draft KV at position p is made from (x_{p+1}, aux_p). The buffer holds
(x_p, aux_p) for positions [S - n, S), where S is the request's length before this step;
the extend (SGLang's `_draft_extend_for_prefill`) rotates the tokens left by one and
appends the request's newest token x_S, exactly as after a prefill.

The host is the only bookkeeper: which row a request-pool slot uses and how full it is live
in numpy, and each append sends those indices to the device with the data. So a slot can be
reset from any thread or stream (a release, a prefill) without a device write to race with.
The indices go through pinned memory with a non-blocking copy (`upload`): a copy from pageable
memory waits for the GPU to drain, which on every off step stalls SGLang's overlap scheduler.

Rows are taken on a slot's first buffered token and given back when its buffer empties, so
the buffers hold only requests that ran while the gate was off. They start small and double
when more such requests run at once, never past the request pool: memory follows the load the
gate actually sees, not SGLang's default pool of 2048-4096 slots.

No SGLang import here: the SGLang adapter (`specgate.sglang.trueoff`) and the CPU tests
share this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def upload(array: np.ndarray, device) -> torch.Tensor:
    """A host index array on `device` without a host sync.

    torch copies pageable memory to a GPU synchronously (the host waits for the stream to drain), so
    the array goes through pinned memory and a non-blocking copy. PyTorch's pinned-memory cache does
    not hand the block out again before that copy has completed, so the array may change right after."""
    if torch.device(device).type != "cuda":
        return torch.from_numpy(np.array(array)).to(device)  # a copy, as on the GPU
    return torch.from_numpy(np.ascontiguousarray(array)).pin_memory().to(device, non_blocking=True)


@dataclass
class CatchUp:
    """Which batch rows to extend, and over which positions."""

    sel: np.ndarray  # row indices into the batch
    slots: np.ndarray  # request-pool slots of those rows
    counts: np.ndarray  # buffered tokens per row (n)
    starts: np.ndarray  # first buffered position per row (S - n)
    seq_lens: np.ndarray  # S per row

    @property
    def total(self) -> int:
        return int(self.counts.sum())


class AuxBuffers:
    """tokens [R, W] and aux states [R, W, A] in rows lent to request-pool slots, with fill counts."""

    def __init__(self, pool_size: int, window: int, aux_dim: int, dtype: torch.dtype, device, rows: int = 64):
        if window < 1:
            raise ValueError(f"true-off buffer window must be >= 1, got {window}")
        self.window, self.pool_size, self.device = window, pool_size, device
        self.n_cpu = np.zeros(pool_size, dtype=np.int64)  # buffered tokens per slot
        self.row_of = np.full(pool_size, -1, dtype=np.int64)  # slot -> buffer row, -1: none
        rows = max(1, min(rows, pool_size))
        self.free_rows = list(range(rows))
        self.tokens = torch.zeros(rows, window, dtype=torch.int64, device=device)
        self.aux = torch.zeros(rows, window, aux_dim, dtype=dtype, device=device)
        self.grown = 0

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.tokens, self.aux))

    def _take_rows(self, slots_cpu: np.ndarray) -> None:
        need = slots_cpu[self.row_of[slots_cpu] < 0]
        if need.size > len(self.free_rows):
            self._grow(need.size - len(self.free_rows))
        for s in need:
            self.row_of[s] = self.free_rows.pop()

    def _grow(self, at_least: int) -> None:
        old = self.rows
        new = min(self.pool_size, max(2 * old, old + at_least))
        if new - old < at_least:
            raise RuntimeError(f"true-off buffers: {old + at_least} rows wanted, the request pool has {self.pool_size}")
        self.tokens = torch.cat([self.tokens, self.tokens.new_zeros(new - old, self.window)])
        self.aux = torch.cat([self.aux, self.aux.new_zeros(new - old, *self.aux.shape[1:])])
        self.free_rows.extend(range(new - 1, old - 1, -1))
        self.grown += 1

    def append(self, slots_cpu: np.ndarray, tokens: torch.Tensor, aux: torch.Tensor) -> None:
        """Buffer one (token, aux) per row at each row's next free index. Rows must have room."""
        self._take_rows(slots_cpu)
        where = upload(np.stack([self.row_of[slots_cpu], self.n_cpu[slots_cpu]]), self.device)
        self.tokens[where[0], where[1]] = tokens.to(torch.int64)
        self.aux[where[0], where[1]] = aux.to(self.aux.dtype)
        self.n_cpu[slots_cpu] += 1

    def reset(self, slots_cpu: np.ndarray) -> None:
        """Empty these slots' buffers (caught up, or a new request in the slot) and give back their rows."""
        slots_cpu = np.asarray(slots_cpu, dtype=np.int64)
        rows = self.row_of[slots_cpu]
        self.free_rows.extend(int(r) for r in rows[rows >= 0])
        self.row_of[slots_cpu] = -1
        self.n_cpu[slots_cpu] = 0

    def pending(self, slots_cpu: np.ndarray) -> bool:
        return bool(self.n_cpu[slots_cpu].any())

    def full(self, slots_cpu: np.ndarray) -> bool:
        """Whether any of these rows has filled its buffer (time for a flush)."""
        return bool((self.n_cpu[slots_cpu] >= self.window).any())

    def plan(self, slots_cpu: np.ndarray, seq_lens_cpu: np.ndarray) -> CatchUp | None:
        """The rows whose draft KV is behind: every row with buffered tokens."""
        n = self.n_cpu[slots_cpu]
        sel = np.nonzero(n > 0)[0]
        if sel.size == 0:
            return None
        counts = n[sel]
        seq = np.asarray(seq_lens_cpu, dtype=np.int64)[sel]
        if (seq < counts).any():
            raise RuntimeError(f"true-off buffer holds more tokens than the request has: n={counts}, S={seq}")
        return CatchUp(sel=sel, slots=np.asarray(slots_cpu)[sel], counts=counts, starts=seq - counts, seq_lens=seq)

    def gather(self, plan: CatchUp, req_to_token: torch.Tensor):
        """Flattened extend inputs for `plan`: token ids, aux states and KV slots, row after row."""
        offsets = np.arange(plan.total) - np.repeat(np.cumsum(plan.counts) - plan.counts, plan.counts)
        index = np.stack([np.repeat(self.row_of[plan.slots], plan.counts), offsets,
                          np.repeat(plan.slots, plan.counts), np.repeat(plan.starts, plan.counts) + offsets])  # fmt: skip
        rows, offs, slots, positions = upload(index, self.device)
        return self.tokens[rows, offs], self.aux[rows, offs], req_to_token[slots, positions]
