"""The true-off gate's per-request buffers: the positions, tokens and KV slots of a catch-up."""

import numpy as np
import pytest
import torch

from specgate.sglang.aux_buffers import AuxBuffers


def _req_to_token(pool, width, seed=0):
    # random, distinct KV slots per (request, position), as a real allocator hands them out
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(pool * width, generator=g).view(pool, width).to(torch.int32)


def test_catch_up_gathers_each_rows_buffered_positions_in_order():
    pool, width, aux_dim = 6, 40, 3
    buf = AuxBuffers(pool, window=8, aux_dim=aux_dim, dtype=torch.float32, device="cpu")
    r2t = _req_to_token(pool, width)
    slots = np.array([4, 1, 3])
    seq = np.array([10, 5, 7])  # length before the first off step
    written = {int(s): [] for s in slots}
    for step in range(3):  # three off steps for every row
        rows = slots if step != 1 else slots[:2]  # slot 3 misses a step (not in that batch)
        for s in rows:
            pos = int(seq[list(slots).index(s)]) + len(written[int(s)])
            written[int(s)].append(pos)
        tok = torch.tensor([100 * int(s) + len(written[int(s)]) for s in rows])
        aux = torch.stack([torch.full((aux_dim,), float(100 * int(s) + len(written[int(s)]))) for s in rows])
        buf.append(torch.from_numpy(rows), rows, tok, aux)
    now = np.array([seq[i] + len(written[int(s)]) for i, s in enumerate(slots)])
    plan = buf.plan(slots, now)
    assert plan.sel.tolist() == [0, 1, 2] and plan.counts.tolist() == [3, 3, 2]
    assert plan.starts.tolist() == seq.tolist()
    ids, aux, loc = buf.gather(plan, r2t)
    want_ids = [100 * int(s) + k + 1 for s in slots for k in range(len(written[int(s)]))]
    assert ids.tolist() == want_ids and aux[:, 0].tolist() == [float(x) for x in want_ids]
    want_loc = [int(r2t[int(s), p]) for s in slots for p in written[int(s)]]
    assert loc.tolist() == want_loc


def test_full_rows_and_reset():
    buf = AuxBuffers(4, window=2, aux_dim=1, dtype=torch.float32, device="cpu")
    for _ in range(2):
        buf.append(torch.tensor([2]), np.array([2]), torch.tensor([7]), torch.ones(1, 1))
    buf.append(torch.tensor([0]), np.array([0]), torch.tensor([7]), torch.ones(1, 1))
    slots, seq = np.array([0, 2]), np.array([5, 9])
    assert buf.plan(slots, seq, full_only=True).slots.tolist() == [2]
    assert buf.plan(slots, seq).slots.tolist() == [0, 2]
    buf.reset(torch.tensor([2, 0]), np.array([2, 0]))
    assert buf.plan(slots, seq) is None and not buf.pending(slots)
    assert int(buf.n_gpu.sum()) == 0


def test_more_buffered_than_the_request_holds_is_an_error():
    buf = AuxBuffers(2, window=4, aux_dim=1, dtype=torch.float32, device="cpu")
    for _ in range(3):
        buf.append(torch.tensor([1]), np.array([1]), torch.tensor([1]), torch.ones(1, 1))
    with pytest.raises(RuntimeError, match="more tokens than the request has"):
        buf.plan(np.array([1]), np.array([2]))
    with pytest.raises(ValueError, match="window"):
        AuxBuffers(2, window=0, aux_dim=1, dtype=torch.float32, device="cpu")
