"""The true-off gate's per-request buffers: the positions, tokens and KV slots of a catch-up."""

import numpy as np
import pytest
import torch

from specgate.sglang.aux_buffers import AuxBuffers, upload


def _req_to_token(pool, width, seed=0):
    # random, distinct KV slots per (request, position), as a real allocator hands them out
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(pool * width, generator=g).view(pool, width).to(torch.int32)


def test_catch_up_gathers_each_rows_buffered_positions_in_order():
    pool, width, aux_dim = 6, 40, 3
    buf = AuxBuffers(pool, window=8, aux_dim=aux_dim, dtype=torch.float32, device="cpu", rows=1)  # grows
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
        buf.append(rows, tok, aux)
    now = np.array([seq[i] + len(written[int(s)]) for i, s in enumerate(slots)])
    plan = buf.plan(slots, now)
    assert plan.sel.tolist() == [0, 1, 2] and plan.counts.tolist() == [3, 3, 2]
    assert plan.starts.tolist() == seq.tolist()
    ids, aux, loc = buf.gather(plan, r2t)
    want_ids = [100 * int(s) + k + 1 for s in slots for k in range(len(written[int(s)]))]
    assert ids.tolist() == want_ids and aux[:, 0].tolist() == [float(x) for x in want_ids]
    want_loc = [int(r2t[int(s), p]) for s in slots for p in written[int(s)]]
    assert loc.tolist() == want_loc
    assert buf.rows == 3 and buf.grown == 1  # one row to three: three requests ran while off


def test_rows_follow_the_requests_buffered_at_once_not_the_pool():
    buf = AuxBuffers(4096, window=4, aux_dim=2, dtype=torch.float32, device="cpu", rows=8)
    start = buf.nbytes
    for wave in range(50):  # 50 waves of 6 requests through a pool of 4096 slots
        slots = np.arange(6) + 6 * wave
        buf.append(slots, torch.zeros(6), torch.zeros(6, 2))
        buf.reset(slots)  # caught up, finished or released
    assert buf.rows == 8 and buf.nbytes == start and buf.grown == 0
    # a slot reset from the host (a release) empties it at once: the next request there starts at index 0
    buf.append(np.array([7]), torch.tensor([5]), torch.ones(1, 2))
    buf.reset(np.array([7]))
    buf.append(np.array([7]), torch.tensor([9]), torch.ones(1, 2))
    plan = buf.plan(np.array([7]), np.array([20]))
    assert plan.counts.tolist() == [1] and buf.gather(plan, torch.zeros(4096, 32, dtype=torch.int32))[0].tolist() == [9]
    with pytest.raises(RuntimeError, match="the request pool has 4"):
        small = AuxBuffers(4, window=2, aux_dim=1, dtype=torch.float32, device="cpu", rows=2)
        small.append(np.arange(5) % 4, torch.zeros(5), torch.zeros(5, 1))  # 4 slots, a fifth would not fit


def test_full_rows_and_reset():
    buf = AuxBuffers(4, window=2, aux_dim=1, dtype=torch.float32, device="cpu")
    for _ in range(2):
        buf.append(np.array([2]), torch.tensor([7]), torch.ones(1, 1))
    buf.append(np.array([0]), torch.tensor([7]), torch.ones(1, 1))
    slots, seq = np.array([0, 2]), np.array([5, 9])
    assert buf.full(slots) and not buf.full(np.array([0]))
    assert buf.plan(slots, seq).slots.tolist() == [0, 2]  # a flush takes every row with buffered tokens
    buf.reset(np.array([2, 0]))
    assert buf.plan(slots, seq) is None and not buf.pending(slots)
    assert sorted(buf.free_rows) == list(range(buf.rows)) and (buf.row_of == -1).all()


def test_more_buffered_than_the_request_holds_is_an_error():
    buf = AuxBuffers(2, window=4, aux_dim=1, dtype=torch.float32, device="cpu")
    for _ in range(3):
        buf.append(np.array([1]), torch.tensor([1]), torch.ones(1, 1))
    with pytest.raises(RuntimeError, match="more tokens than the request has"):
        buf.plan(np.array([1]), np.array([2]))
    with pytest.raises(ValueError, match="window"):
        AuxBuffers(2, window=0, aux_dim=1, dtype=torch.float32, device="cpu")


def test_upload_leaves_the_source_array_free_to_change():
    # the bookkeeping changes its numpy arrays right after each append: the device copy must not follow
    src = np.array([[3, 1], [0, 2]])
    got = upload(src, "cpu")
    src[:] = 9
    assert got.tolist() == [[3, 1], [0, 2]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs exist only with a GPU stream")
def test_an_off_step_and_a_catch_up_never_wait_for_the_gpu():
    # a copy from pageable memory waits for the stream to drain; on every off step that stalls SGLang's
    # overlap scheduler (gate-off decode fell to 0.64-0.74 of no-spec on an 8B shape)
    buf = AuxBuffers(64, window=4, aux_dim=8, dtype=torch.bfloat16, device="cuda", rows=2)
    r2t = _req_to_token(64, 64).cuda()
    slots = np.array([5, 9, 17])
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            buf.append(slots, torch.ones(3, device="cuda"), torch.ones(3, 8, device="cuda"))  # grows too
        ids, aux, loc = buf.gather(buf.plan(slots, np.array([10, 10, 10])), r2t)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert ids.shape == (9,) and loc.tolist() == [int(r2t[s, p]) for s in slots for p in (7, 8, 9)]
