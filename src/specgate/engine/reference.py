"""The reference engine: continuous batching for a Llama target with an optional EAGLE-3 drafter.

One engine thread owns the models. Each loop it admits waiting requests into free KV
slots (prefill, one request at a time), asks the gate whether this decode step drafts,
and runs either a speculative chain step or a plain decode step over every running
request. Tokens go back to callers through callbacks. The step logic is
`specgate.model.spec_decode`, the same code that measures acceptance offline.
"""

from __future__ import annotations

import bisect
import heapq
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specgate.gate import RESUMED_STEPS, AutoConfig, AutoGate, Gate, GateConfig
from specgate.gate_control import GateControl
from specgate.model.llama import LlamaRunner
from specgate.model.spec_decode import Request, SpecDecoder, load_drafter

log = logging.getLogger(__name__)


class EngineClosed(RuntimeError):
    pass


@dataclass
class EngineConfig:
    target_dir: str
    draft_dir: str | None = None
    num_steps: int = 3
    gate: GateConfig | AutoConfig = field(default_factory=lambda: GateConfig(None))  # AutoConfig: the auto gate
    max_running: int = 32
    max_len: int = 2048
    device: str = "cpu"
    dtype: str = "auto"  # "auto" = the checkpoint's dtype; "float32" for bit-exact greedy checks
    gate_control: str | None = None  # a file whose changes switch the gate at run time (specgate.gate_control)


@dataclass
class Job:
    """A request in flight, with the callbacks that deliver its tokens."""

    request: Request
    on_tokens: Callable[[list[int]], None]
    on_done: Callable[[str | None, str | None], None]  # (finish_reason, error)
    submitted: float = field(default_factory=time.perf_counter)
    delivered: int = 0
    cancelled: bool = False  # its client went away: retired at the next step, its slot freed


class Engine:
    def __init__(self, cfg: EngineConfig):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from specgate.model.chat import eos_ids
        from specgate.runtime import keep_freed_memory

        keep_freed_memory()
        self.cfg = cfg
        model = AutoModelForCausalLM.from_pretrained(cfg.target_dir, dtype=cfg.dtype).to(cfg.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.target_dir)
        self.eos = eos_ids(model, self.tokenizer)
        drafter = load_drafter(cfg.draft_dir, cfg.device, next(model.parameters()).dtype) if cfg.draft_dir else None
        aux = drafter.config.eagle_config["eagle_aux_hidden_state_layer_ids"] if drafter else []
        self.decoder = SpecDecoder(LlamaRunner(model, aux), drafter, slots=cfg.max_running, max_len=cfg.max_len)
        self.speculative = drafter is not None
        self.gate = AutoGate(cfg.gate) if isinstance(cfg.gate, AutoConfig) else Gate(cfg.gate)
        self.control = GateControl(cfg.gate_control, self.gate) if cfg.gate_control else None
        self._waiting: queue.Queue[Job] = queue.Queue()
        self._running: list[Job] = []
        # Free slots as a min-heap, and the running batch kept in slot order: under a steady load the batch
        # then holds slots 0..B-1 in order, and the KV cache attends to them over views, without the copy
        # that gathers a scattered batch.
        self._free = list(range(cfg.max_running))
        self._closed = threading.Event()
        self.verify_steps = 0
        self.accepted_tokens = 0
        self.resumed = [0, 0]  # verify steps, accepted tokens within RESUMED_STEPS after an off step
        self.since_off = None  # speculative steps since the last off step; None: never off
        self.steps = deque(maxlen=20000)  # (mode, batch, tokens_out, seconds): data for the cost model
        # cumulative [steps, rows, tokens, seconds] by side: the server's own step cost, read per block
        self.step_counters = {"plain": [0, 0, 0, 0.0], "spec": [0, 0, 0, 0.0]}
        self._thread = threading.Thread(target=self._loop, name="specgate-engine", daemon=True)
        self._thread.start()

    # -- public -------------------------------------------------------------------

    def submit(self, prompt: list[int], max_new_tokens: int, ignore_eos: bool, on_tokens, on_done) -> Job:
        if self._closed.is_set():
            raise EngineClosed("engine is shutting down")
        if len(prompt) + max_new_tokens + self.cfg.num_steps + 2 > self.cfg.max_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({max_new_tokens}) exceeds the context "
                             f"limit {self.cfg.max_len - self.cfg.num_steps - 2}")  # fmt: skip
        job = Job(Request(-1, prompt, max_new_tokens, self.eos, ignore_eos), on_tokens, on_done)
        self._waiting.put(job)
        return job

    def cancel(self, job: Job) -> None:
        """Stop decoding for a request whose client has gone; the engine thread retires it."""
        job.cancelled = True

    def stats(self) -> dict:
        return {
            "avg_spec_accept_length": self.accepted_tokens / self.verify_steps if self.verify_steps else None,
            "spec_verify_steps": self.verify_steps,
            "spec_accepted_tokens": self.accepted_tokens,
            "spec_verify_steps_resumed": self.resumed[0],
            "spec_accepted_tokens_resumed": self.resumed[1],
            "running": len(self._running),
            "waiting": self._waiting.qsize(),
            "speculative": self.speculative,
            "num_steps": self.cfg.num_steps if self.speculative else 0,
            "gate": self.gate.counters() | ({"control_generation": self.control.generation} if self.control else {}),
            "step_counters": {k: list(v) for k, v in self.step_counters.items()},
        }

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; every request still waiting or running gets an error."""
        self._closed.set()
        self._waiting.put(None)  # wake the loop
        self._thread.join(timeout)
        for job in self._running:
            job.on_done(None, "server shutting down")
        self._running.clear()
        while True:
            try:
                job = self._waiting.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.on_done(None, "server shutting down")

    # -- the loop -----------------------------------------------------------------

    def _admit(self) -> None:
        block = not self._running
        while self._free and not self._closed.is_set():
            try:
                job = self._waiting.get(timeout=0.05) if block else self._waiting.get_nowait()
            except queue.Empty:
                return
            if job is None:
                return
            if job.cancelled:
                job.on_done("abort", None)
                continue
            block = False
            job.request.slot = heapq.heappop(self._free)
            try:
                # while the gate is off the draft prefill waits for the catch-up too
                self.decoder.prefill(job.request, sync_draft=self.gate.on)
            except Exception as e:  # this request fails; the others go on
                log.exception("prefill failed")
                heapq.heappush(self._free, job.request.slot)
                job.on_done(None, f"engine error: {e}")
                continue
            bisect.insort(self._running, job, key=lambda j: j.request.slot)
            self._deliver(job)

    def _deliver(self, job: Job) -> None:
        out = job.request.output
        if len(out) > job.delivered:
            job.on_tokens(out[job.delivered :])
            job.delivered = len(out)

    def _loop(self) -> None:
        with torch.inference_mode():
            while not self._closed.is_set():
                try:
                    if self.control is not None:  # between steps: a switch never splits one
                        self.gate = self.control.poll()
                    self._admit()
                    self._retire()
                    if not self._running:
                        continue
                    reqs = [j.request for j in self._running]
                    speculate = self.speculative and self.gate.decide(len(reqs))
                    before = sum(len(r.output) for r in reqs)
                    t0 = time.perf_counter()
                    if speculate:
                        v0, a0 = sum(r.verify_steps for r in reqs), sum(r.accepted_tokens for r in reqs)
                        self.decoder.spec_step(reqs, self.cfg.num_steps)
                        v, a = sum(r.verify_steps for r in reqs) - v0, sum(r.accepted_tokens for r in reqs) - a0
                        self.verify_steps, self.accepted_tokens = self.verify_steps + v, self.accepted_tokens + a
                        if self.since_off is not None and self.since_off < RESUMED_STEPS:
                            self.resumed = [self.resumed[0] + v, self.resumed[1] + a]
                            self.since_off += 1
                    else:  # true off: no draft work; the draft catches up when speculation resumes
                        self.decoder.plain_step(reqs, sync_draft=False)
                        self.since_off = 0
                    made, seconds = sum(len(r.output) for r in reqs) - before, time.perf_counter() - t0
                    side = "spec" if speculate else "plain"
                    self.steps.append((side, len(reqs), made, seconds))
                    c = self.step_counters[side]
                    c[0], c[1], c[2], c[3] = c[0] + 1, c[1] + len(reqs), c[2] + made, c[3] + seconds
                    if self.speculative:  # the engine's own timer: what the auto gate decides from
                        self.gate.observe_time(len(reqs), speculate, seconds)
                        if speculate:
                            self.gate.observe_tokens(len(reqs), made)
                    for job in self._running:
                        self._deliver(job)
                    self._retire()
                except Exception as e:  # a failed step must not hang its callers
                    log.exception("engine step failed")
                    for job in self._running:
                        heapq.heappush(self._free, job.request.slot)
                        job.on_done(None, f"engine error: {e}")
                    self._running.clear()

    def _retire(self) -> None:
        still = []
        for job in self._running:
            r = job.request
            if job.cancelled:
                heapq.heappush(self._free, r.slot)
                job.on_done("abort", None)
            elif r.done:
                heapq.heappush(self._free, r.slot)
                stopped = bool(r.output) and not r.ignore_eos and r.output[-1] in r.eos_ids
                job.on_done("stop" if stopped else "length", None)
            else:
                still.append(job)
        self._running = still
