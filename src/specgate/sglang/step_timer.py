"""Decode step times for the auto gate, taken on the device around each step.

The interval between two decode launches is not a step time under SGLang's overlap scheduler: the
host launches step k+1 while the GPU runs step k, so an interval is paced by an earlier step, and
the interval after a prefill carries the prefill. Under load a prefill sits between most decode
steps, and those intervals made plain steps look several times slower than they are.

So each decode step is bracketed by two CUDA events on the stream it runs on, and the pair is read
once the second has completed (`Event.query()`, which never waits), oldest first. The elapsed time
is the step's own: it starts when the stream reaches the step, after whatever ran before it, and
includes the launch gaps inside the step. Off a GPU (the CPU tests) the steps run synchronously and
the host clock brackets them the same way.
"""

from __future__ import annotations

import time
from collections import deque

import torch

MAX_PENDING = 256  # steps in flight are a handful; a stream that never completes must not grow this


class StepTimer:
    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.pending = deque()  # (running, speculated, start, end) in launch order
        self.spare = []  # events of read steps, reused
        self.open = None
        self.dropped = 0

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = self.spare.pop() if self.spare else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def begin(self, running: int, speculated: bool) -> None:
        """Before the step's first launch: the step about to run."""
        if self.cuda and torch.cuda.is_current_stream_capturing():
            self.open = None  # a graph capture records no timing events
            return
        self.open = (running, speculated, self._mark())

    def untypical(self) -> None:
        """The open step also did other work (a catch-up of the draft): it is reported without a time."""
        if self.open is not None and self.open[2] is not None:
            if self.cuda:
                self.spare.append(self.open[2])  # recorded, never read: free to record again
            self.open = (*self.open[:2], None)

    def end(self) -> None:
        """After the step's last launch."""
        if self.open is None:
            return
        self.pending.append((*self.open, None if self.open[2] is None else self._mark()))
        self.open = None
        if len(self.pending) > MAX_PENDING:
            self.pending.popleft()
            self.dropped += 1

    def finished(self):
        """(running, speculated, seconds) of every step that has completed, oldest first (seconds
        None for an untypical step)."""
        while self.pending:
            running, speculated, start, end = self.pending[0]
            if start is None:  # untypical: its place in the order only
                seconds = None
            elif self.cuda:
                if not end.query():
                    return
                seconds = start.elapsed_time(end) / 1000
                self.spare += [start, end]
            else:
                seconds = end - start
            self.pending.popleft()
            yield running, speculated, seconds
