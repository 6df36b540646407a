"""Per-request buffers of a true-off gate: the bookkeeping, in plain torch.

While the gate is off, each decode step runs the target alone. For every new token the
target's EAGLE-3 aux hidden states (low/mid/high layers, 3·H values) are kept with the
token, in a row per request-pool slot. When drafting resumes, one batched draft extend
over the buffered tokens writes the draft KV the off steps skipped.

EAGLE's shift: the draft KV at position p is made from (x_{p+1}, aux_p). The buffer holds
(x_p, aux_p) for positions [S - n, S), where S is the request's length before this step;
the extend (SGLang's `_draft_extend_for_prefill`) rotates the tokens left by one and
appends the request's newest token x_S, exactly as after a prefill.

No SGLang import here: the SGLang adapter (`specgate.sglang.trueoff`) and the CPU tests
share this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


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
    """tokens [P, W] and aux states [P, W, A] per request-pool slot, with a fill count n.

    The count lives twice: `n_gpu` for the device-side append (no host sync per step) and
    `n_cpu` for the host-side decisions (which rows to catch up, which are full). Both move
    together because every append and reset goes through this class.
    """

    def __init__(self, pool_size: int, window: int, aux_dim: int, dtype: torch.dtype, device):
        if window < 1:
            raise ValueError(f"true-off buffer window must be >= 1, got {window}")
        self.window = window
        self.tokens = torch.zeros(pool_size, window, dtype=torch.int64, device=device)
        self.aux = torch.zeros(pool_size, window, aux_dim, dtype=dtype, device=device)
        self.n_gpu = torch.zeros(pool_size, dtype=torch.int64, device=device)
        self.n_cpu = np.zeros(pool_size, dtype=np.int64)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.tokens, self.aux, self.n_gpu))

    def append(self, slots_gpu: torch.Tensor, slots_cpu: np.ndarray, tokens: torch.Tensor, aux: torch.Tensor) -> None:
        """Buffer one (token, aux) per row at each row's next free index. Rows must have room."""
        idx = self.n_gpu[slots_gpu]
        self.tokens[slots_gpu, idx] = tokens.to(torch.int64)
        self.aux[slots_gpu, idx] = aux.to(self.aux.dtype)
        self.n_gpu[slots_gpu] = idx + 1
        self.n_cpu[slots_cpu] += 1

    def reset(self, slots_gpu: torch.Tensor, slots_cpu: np.ndarray) -> None:
        self.n_gpu[slots_gpu] = 0
        self.n_cpu[slots_cpu] = 0

    def pending(self, slots_cpu: np.ndarray) -> bool:
        return bool(self.n_cpu[slots_cpu].any())

    def plan(self, slots_cpu: np.ndarray, seq_lens_cpu: np.ndarray, full_only: bool = False) -> CatchUp | None:
        """The rows whose draft KV is behind (or, with full_only, whose buffer is full)."""
        n = self.n_cpu[slots_cpu]
        mask = n >= self.window if full_only else n > 0
        sel = np.nonzero(mask)[0]
        if sel.size == 0:
            return None
        counts = n[sel]
        seq = np.asarray(seq_lens_cpu, dtype=np.int64)[sel]
        if (seq < counts).any():
            raise RuntimeError(f"true-off buffer holds more tokens than the request has: n={counts}, S={seq}")
        return CatchUp(sel=sel, slots=np.asarray(slots_cpu)[sel], counts=counts, starts=seq - counts, seq_lens=seq)

    def gather(self, plan: CatchUp, req_to_token: torch.Tensor):
        """Flattened extend inputs for `plan`: token ids, aux states and KV slots, row after row."""
        device = self.tokens.device
        rows = np.repeat(plan.slots, plan.counts)
        offsets = np.arange(plan.total) - np.repeat(np.cumsum(plan.counts) - plan.counts, plan.counts)
        positions = np.repeat(plan.starts, plan.counts) + offsets
        rows_t = torch.from_numpy(rows).to(device)
        offs_t = torch.from_numpy(offsets).to(device)
        pos_t = torch.from_numpy(positions).to(device)
        input_ids = self.tokens[rows_t, offs_t]
        aux = self.aux[rows_t, offs_t]
        out_cache_loc = req_to_token[rows_t, pos_t]
        return input_ids, aux, out_cache_loc
