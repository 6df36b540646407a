"""The auto gate's decode step timer: steps come out in launch order, each with its own time."""

import pytest
import torch

from specgate.sglang import step_timer
from specgate.sglang.step_timer import StepTimer


def test_steps_come_out_oldest_first_with_their_own_time(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(step_timer.time, "perf_counter", lambda: now[0])
    timer = StepTimer("cpu")
    for running, speculated, seconds in [(4, True, 0.03), (5, False, 0.01), (6, False, 0.02)]:
        now[0] += 5.0  # whatever runs between steps is not a step
        timer.begin(running, speculated)
        now[0] += seconds
        timer.end()
    out = list(timer.finished())
    assert [(r, s) for r, s, _ in out] == [(4, True), (5, False), (6, False)]
    assert [t for *_, t in out] == pytest.approx([0.03, 0.01, 0.02])
    assert list(timer.finished()) == []  # each step once


def test_an_untypical_step_keeps_its_place_without_a_time(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(step_timer.time, "perf_counter", lambda: now[0])
    timer = StepTimer("cpu")
    for untypical in (False, True, False):
        timer.begin(8, True)
        now[0] += 0.5 if untypical else 0.02  # a catch-up makes the step long
        if untypical:
            timer.untypical()
        timer.end()
    assert [t for *_, t in timer.finished()] == [pytest.approx(0.02), None, pytest.approx(0.02)]


def test_a_stream_that_never_completes_keeps_a_bounded_backlog(monkeypatch):
    timer = StepTimer("cpu")
    for i in range(step_timer.MAX_PENDING + 10):
        timer.begin(i, False)
        timer.end()
    assert len(timer.pending) == step_timer.MAX_PENDING and timer.dropped == 10
    assert next(timer.finished())[0] == 10  # the oldest kept


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events need a GPU")
def test_cuda_events_time_the_step_without_a_host_sync():
    timer = StepTimer("cuda")
    a = torch.randn(4096, 4096, device="cuda")
    a = a @ a / 64  # the first matmul also sets up cuBLAS (~0.1 s); the timed ones must not
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for n in (1, 8):
            timer.begin(n, n > 1)
            for _ in range(n):
                a = a @ a / 64
            timer.end()
        early = list(timer.finished())  # whatever has completed; never waits
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    out = early + list(timer.finished())
    assert [r for r, *_ in out] == [1, 8]
    one, eight = (t for *_, t in out)
    assert 0 < one < eight and 4 < eight / one < 16  # eight matmuls take about eight times one
