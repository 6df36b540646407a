"""The true-off gate inside SGLang's EAGLE-3 worker (spec v2), through the plugin hook API.

SGLang's own way to stop drafting (an adaptive tier with 0 steps) still runs every decode
step as a speculative one: the target in verify mode with its verify kernels, the draft
extend, and the spec-v2 bookkeeping (docs/design/true-off-gate.md). While the specgate
gate is off, the true-off gate runs the step the way a no-speculation server does instead:

  the target in DECODE mode, replaying a plain decode CUDA graph captured at startup on its
  own attention backend, and the target's ordinary sampler; no draft forward and no draft
  extend. The target's three aux hidden states of each new token are buffered per request
  (`specgate.sglang.aux_buffers.AuxBuffers`).

When the gate turns back on, one batched draft extend over each request's buffered tokens
(SGLang's own prefill draft extend) writes the draft KV the off steps skipped and yields the
draft state that drafting resumes from. While off, once any request's buffer fills up (W
tokens), every buffer in the batch is flushed the same way. Requests admitted while off get
their draft KV from the prefill, as always.

This module is the part every SGLang release shares: the gate's decision per step, the buffers,
the catch-up plan, the host mirror of sequence lengths, what a finishing request may leave in the
prefix cache, and the counters. What touches SGLang's objects lives in one adapter module per line
of SGLang internals (`specgate.sglang.adapters`): building the plain decode graph, running the
off step, running the draft extend, and the hook targets with their signatures. The adapter is
chosen by its contract (`specgate.sglang.contract`): the first whose every internal matches the
installed SGLang's source. Where none matches, the plugin refuses the mode with one line and
leaves SGLang unchanged.

The off step returns a spec-v2 result with one token per request (stride 1, accept length
1), so the scheduler, the KV accounting and the overlap future map work unchanged. Rows with
the speculative path's extras take the off step too: logprobs come from SGLang's own spec-v2
logprob code over the plain logits, grammars mask the target's sampler as in a plain decode
and advance in the result processor, and returned hidden states are the step's aux rows.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch

from specgate.gate import RESUMED_STEPS, make_gate
from specgate.gate_control import GateControl
from specgate.sglang import contract
from specgate.sglang.aux_buffers import AuxBuffers, upload
from specgate.sglang.logs import log, say
from specgate.sglang.step_timer import StepTimer

# one module per line of SGLang internals, oldest first; each names the releases it was checked against
ADAPTERS = ("specgate.sglang.adapters.v0_5_15", "specgate.sglang.adapters.v0_5_17", "specgate.sglang.adapters.v0_5_23")
INFO_KEY = "specgate_gate"  # the gate's counters in /server_info's internal_states
LOG_EVERY = 2000  # decode steps between counter lines
SLOW_FACTOR, MAX_STEP_NOTES = 4.0, 400  # note_time: a slow step, and the most lines it writes
STATS_ENV = "SPECGATE_STATS_DIR"  # if set, rank 0 keeps its counters in a JSON file there
sglang_source_dir = contract.sglang_source_dir


def adapters() -> list:
    return [importlib.import_module(name) for name in ADAPTERS]


def select_adapter(srt_dir: Path | None = None):
    """(the adapter whose contract the SGLang at `srt_dir` meets, None) or (None, why none does)."""
    srt_dir = srt_dir or sglang_source_dir()
    if srt_dir is None:
        return None, "SGLang is not installed"
    version = contract.installed_version(srt_dir)
    firsts = []
    for adapter in adapters():
        found = contract.mismatches(srt_dir, adapter.CONTRACT, adapter.FIELDS)
        if not found:
            return adapter, None
        firsts.append(f"{adapter.LINE}: {found[0]}")
    return None, f"SGLang {version} matches no true-off adapter ({'; '.join(firsts)})"


def contract_mismatch(srt_dir: Path | None = None) -> str | None:
    """None if some adapter fits the SGLang at `srt_dir`; else why none does, in one line."""
    return select_adapter(srt_dir)[1]


class TrueOffGate:
    """The gate and the off path of one EAGLEWorkerV2 (one per TP rank)."""

    def __init__(self, worker, settings: dict, adapter):
        self.worker, self.adapter = worker, adapter
        before = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0
        tic = time.perf_counter()
        # the adapter sets target_mr, draft_runner, attn_backend (the gate's own), graph_runner, req_to_token_pool
        aux_dim = adapter.arm(self, worker)
        self.req_to_token = self.req_to_token_pool.req_to_token
        mr = self.target_mr
        self.init_state(settings, self.req_to_token.shape[0], aux_dim, mr.model_config.dtype, mr.device,
                        rank=adapter.tp_rank(worker))  # fmt: skip
        used = (before - torch.cuda.mem_get_info()[0]) / 2**30 if torch.cuda.is_available() else 0.0
        b = self.buffers
        _say(f"specgate true-off armed ({adapter.LINE} adapter): plain decode graph "
             f"bs={getattr(self.graph_runner, 'capture_bs', None)}, "
             f"aux buffers {b.tokens.shape[0]}x{b.window}x{aux_dim} ({b.nbytes / 2**20:.1f} MiB), "
             f"{used:.2f} GB in {time.perf_counter() - tic:.1f} s; sync-free seq_lens {self.sync_free}; "
             f"gate {self.gate.counters()} (pid {os.getpid()})")  # fmt: skip

    def init_state(self, settings: dict, pool: int, aux_dim: int, dtype, device, rank: int = 0) -> None:
        """Everything but the SGLang objects: the gate, the buffers, the host mirror, the counters."""
        self.gate = make_gate(settings)  # a fixed threshold, or the auto gate (settings["auto"])
        self.slot_of = getattr(getattr(self, "adapter", None), "slot_of", None) or (lambda req: req.req_pool_idx)
        # the sweep's run-time switch (one server, every gate); tp 1 only: ranks would read it at different steps
        self.control = GateControl(settings["control"], self.gate) if settings.get("control") else None
        self.timer = StepTimer(device)  # decode step times, for the auto gate
        self.buffers = AuxBuffers(pool, int(settings.get("buffer_tokens", 32)), aux_dim, dtype, device,
                                  rows=int(settings.get("buffer_rows", 64)))  # fmt: skip
        self.ones = torch.ones(pool, dtype=torch.int32, device=device)
        # host mirror of each slot's sequence length after its last step, exact after a prefill or a
        # gate-off step (one token each); lets the next step skip spec v2's device-to-host sync
        self.sync_free = bool(settings.get("sync_free_seq_lens", True))
        self.check_mirror_every = int(settings.get("check_mirror_every", 0))  # debug: compare with the device
        self.len_cpu = np.zeros(pool, dtype=np.int64)
        self.len_ok = np.zeros(pool, dtype=bool)
        self.catchups = self.flushes = self.caught_up_tokens = 0
        self.plain_steps = self.original_steps = self.sync_free_resolves = self.mirror_checks = 0
        self.released = self.trimmed_requests = self.trimmed_tokens = 0
        self.since_catchup = RESUMED_STEPS
        self.fastest_step, self.step_notes = {}, 0  # (speculated, running) -> fastest step seen, for note_time
        # cumulative [steps, rows, tokens, seconds] of the timed decode steps by side, read by the sweep per
        # block: the server's own step cost beside the client's throughput (tokens: a plain step's only)
        self.step_counters = {"plain": [0, 0, 0, 0.0], "spec": [0, 0, 0, 0.0]}
        # acceptance of speculative steps: [request-steps, tokens] just after a catch-up and otherwise
        self.accept = {"resumed": [0, 0], "steady": [0, 0]}
        stats_dir = os.environ.get(STATS_ENV)
        self.stats_path = Path(stats_dir) / f"gate_stats_{os.getpid()}.json" if stats_dir and rank == 0 else None

    def _mirror(self, slots_cpu: np.ndarray, seq_lens_cpu, add: int) -> None:
        if seq_lens_cpu is not None:
            self.len_cpu[slots_cpu] = np.asarray(seq_lens_cpu, dtype=np.int64) + add
            self.len_ok[slots_cpu] = True
        elif add:  # no host copy this step (triton keeps none): a gate-off step adds exactly one token
            self.len_cpu[slots_cpu] += add
        else:
            self.len_ok[slots_cpu] = False

    def host_seq_lens(self, batch, slots_cpu: np.ndarray) -> np.ndarray:
        """This step's lengths on the host for the rows behind: the batch's copy, else the mirror (exact
        for rows admitted while off), else one device read (a host sync)."""
        if batch.seq_lens_cpu is not None:
            return batch.seq_lens_cpu.numpy()
        behind = self.buffers.n_cpu[slots_cpu] > 0
        if self.len_ok[slots_cpu][behind].all():
            return self.len_cpu[slots_cpu]
        return batch.seq_lens.cpu().numpy()

    def resolve_seq_lens(self, future_map, batch) -> bool:
        """spec v2's per-step seq_lens relay without its host sync, when the host already knows them.

        Does the device side exactly as SGLang does (stream wait on the publish event, gather the
        published lengths) and takes the host copy from the mirror. False: call SGLang's own."""
        spec = batch.spec_info
        fi = getattr(spec, "future_indices", None) if spec is not None else None
        if not self.sync_free or fi is None or not getattr(future_map, "needs_cpu_seq_lens", False):
            return False
        slots = _slots_cpu(batch, self.slot_of)
        if slots.size == 0 or not self.len_ok[slots].all():
            return False
        if future_map.publish_ready is not None:
            future_map.publish_ready.wait()
        batch.seq_lens = future_map.new_seq_lens_buf[fi]
        batch.seq_lens_cpu = torch.from_numpy(self.len_cpu[slots].copy())
        batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
        self.sync_free_resolves += 1
        if self.check_mirror_every and self.sync_free_resolves % self.check_mirror_every == 0:
            self.check_mirror(slots, batch.seq_lens)
        return True

    def check_mirror(self, slots: np.ndarray, seq_lens_device) -> None:
        """Debug mode: the host mirror against the device lengths (a host sync); a mismatch stops serving."""
        device = seq_lens_device.cpu().numpy().astype(np.int64)
        self.mirror_checks += 1
        bad = np.nonzero(device != self.len_cpu[slots])[0]
        if bad.size:
            rows = ", ".join(f"slot {slots[i]}: mirror {self.len_cpu[slots[i]]} device {device[i]}" for i in bad[:8])
            raise RuntimeError(f"specgate true-off: host seq_lens mirror differs from the device at {bad.size} rows ({rows})")

    # -- the step --------------------------------------------------------------------------------

    def forward(self, original, batch, on_publish, **extra):
        """One EAGLEWorkerV2.forward_batch_generation call; `extra` is what this release's signature adds."""
        worker = self.worker
        if batch.forward_mode.is_extend() or batch.is_extend_in_batch:
            out = original(worker, batch, on_publish, **extra)
            slots_cpu = _slots_cpu(batch, self.slot_of)
            if slots_cpu.size:  # new requests: the prefill built their draft KV
                self.buffers.reset(slots_cpu)
                self._mirror(slots_cpu, batch.seq_lens_cpu, 0)  # spec v2: length before the first decode token
            return out
        if batch.forward_mode.is_idle() or not batch.reqs:
            return original(worker, batch, on_publish, **extra)
        # the auto gate's step times: steps timed on the device, fed in once they have completed (the
        # tokens of a speculative step arrive in count_accepted)
        for running, speculated, seconds in self.timer.finished():
            self.note_time(running, speculated, seconds)
            if seconds is not None:
                c = self.step_counters["spec" if speculated else "plain"]
                c[0], c[1], c[3] = c[0] + 1, c[1] + running, c[3] + seconds
                c[2] += 0 if speculated else running
            self.gate.observe_time(running, speculated, seconds)
        if self.control is not None:
            self.gate = self.control.poll()
        before = self.gate.switches
        on = self.gate.decide(len(batch.reqs))
        plain_ok = _has_bonus(batch)  # False only before a request's first draft state exists
        if self.gate.switches != before or (self.gate.steps_on + self.gate.steps_off) % LOG_EVERY == 0:
            log.info("specgate gate %s at batch %d: %s", "on" if on else "off", len(batch.reqs), json.dumps(self.counters()))
            self.write_stats()
        speculate = on or not plain_ok
        self.timer.begin(len(batch.reqs), speculate)
        out = self.decode_step(original, batch, on_publish, speculate, **extra)
        self.timer.end()
        return out

    def note_time(self, running: int, speculated: bool, seconds: float | None) -> None:
        """Log each side's first timed step at each batch size, and steps over SLOW_FACTOR x the fastest
        seen there: a cost paid on first use (a kernel compiled, memory grown) shows in the server log
        with its batch size and side, not only as a skew in the auto gate's estimates."""
        if seconds is None:
            return
        key = (speculated, running)
        fastest = self.fastest_step.get(key)
        first, slow = fastest is None, fastest is not None and seconds > SLOW_FACTOR * fastest
        if (first or slow) and self.step_notes < MAX_STEP_NOTES:
            self.step_notes += 1
            log.info("specgate step time: %s at batch %d, %.2f ms (%s)", "spec" if speculated else "plain", running,
                     seconds * 1e3, "first timed" if first else f"{seconds / fastest:.1f}x the fastest")  # fmt: skip
        self.fastest_step[key] = seconds if first else min(fastest, seconds)

    def decode_step(self, original, batch, on_publish, speculate: bool, **extra):
        slots_cpu = _slots_cpu(batch, self.slot_of)
        if speculate:
            if self.buffers.pending(slots_cpu):
                self.catch_up(batch, slots_cpu, resume=True)
                self.timer.untypical()  # its time is the catch-up's as much as the step's
                self.since_catchup = 0
            self.original_steps += 1
            self.len_ok[slots_cpu] = False  # the accept lengths reach the host only later
            out = original(self.worker, batch, on_publish, **extra)
            out._specgate_resumed = self.since_catchup < RESUMED_STEPS  # read back when the result is processed
            self.since_catchup += 1
            return out
        if self.buffers.full(slots_cpu):
            # a flush: every row with buffered tokens, not only the full ones. It is one eager draft
            # forward, whose launch cost does not grow with its rows, and requests that arrive one by
            # one fill their buffers on different steps: flushing only the full rows ran an extend
            # every few steps at batch 128; flushing all runs at most one per window.
            self.catch_up(batch, slots_cpu, resume=False)
            self.timer.untypical()
            self.flushes += 1
        self.plain_steps += 1
        self._mirror(slots_cpu, batch.seq_lens_cpu, 1)
        return self.plain_step(batch, slots_cpu, on_publish, **extra)

    def plain_step(self, batch, slots_cpu, on_publish, **extra):
        """One decode step of the target alone, in the result format of a spec-v2 step (the adapter's)."""
        return self.adapter.plain_step(self, batch, slots_cpu, on_publish, **extra)

    def catch_up(self, batch, slots_cpu, resume: bool) -> None:
        """One draft extend over the buffered tokens of the rows behind. resume: drafting starts from
        these rows' fresh draft state (a flush while off discards it)."""
        plan = self.buffers.plan(slots_cpu, self.host_seq_lens(batch, slots_cpu))
        if plan is None:
            return
        sel = upload(plan.sel, batch.seq_lens.device)
        input_ids, aux, out_cache_loc = self.buffers.gather(plan, self.req_to_token)
        fresh = self.adapter.draft_extend(self, batch, plan, sel, input_ids, aux, out_cache_loc)
        if resume:  # drafting resumes from these rows' state
            spec = batch.spec_info
            spec.topk_p[sel] = fresh.topk_p.to(spec.topk_p.dtype)
            spec.topk_index[sel] = fresh.topk_index.to(spec.topk_index.dtype)
            if spec.hidden_states is not None and fresh.hidden_states is not None:
                spec.hidden_states[sel] = fresh.hidden_states.to(spec.hidden_states.dtype)
        self.buffers.reset(plan.slots)
        self.catchups += 1
        self.caught_up_tokens += plan.total

    # -- a request leaves its slot ------------------------------------------------------------------

    def commit_len(self, slot: int | None, committed: int, protected: int, count: bool = True) -> int:
        """How much of a finishing request the prefix cache may keep: up to its first token whose draft
        KV an off step skipped. The rest is freed with the request (SGLang's own route for KV it does
        not keep), so a later prefix hit re-prefills those few tokens instead of drafting on stale KV.
        protected: the prefix the cache already holds for it; count: False when SGLang asks again."""
        n = int(self.buffers.n_cpu[slot]) if slot is not None else 0
        if n == 0:
            return committed
        # at least one token past the prefix the cache already holds: SGLang frees a finishing request's
        # last committed token itself (EAGLE's radix keys are bigrams), which must not be one the cache owns
        keep = min(committed, max(committed - n, protected + 1))
        if count:
            self.trimmed_requests += 1
            self.trimmed_tokens += committed - keep
        return keep

    def release(self, slot: int | None) -> None:
        """A request gave its pool slot back: whoever gets the slot next starts with no buffered tokens
        and no host length, prefill or not."""
        if slot is None:
            return
        self.buffers.reset(np.array([slot]))
        self.len_ok[slot] = False
        self.released += 1

    def recapture(self) -> None:
        """SGLang recaptured the target's decode graphs (a weight update): recapture the plain one too."""
        if self.graph_runner is not None:
            self.graph_runner = self.adapter.plain_decode_runner(self.target_mr, self.attn_backend)
            _say("specgate true-off: plain decode graph recaptured after the target's graphs were")

    def count_accepted(self, result, batch) -> None:
        """Called once the step's accept lengths reach the host; off steps (stride 1) are not counted."""
        if (result.speculative_num_draft_tokens or 1) <= 1 or not hasattr(result, "_specgate_resumed"):
            return
        kind = "resumed" if result._specgate_resumed else "steady"
        self.accept[kind][0] += len(batch.reqs)
        self.accept[kind][1] += result.num_correct_drafts + len(batch.reqs)
        self.gate.observe_tokens(len(batch.reqs), result.num_correct_drafts + len(batch.reqs))

    def counters(self) -> dict:
        rate = {k: round(t / n, 4) if n else None for k, (n, t) in self.accept.items()}
        n, t = (sum(v[i] for v in self.accept.values()) for i in (0, 1))
        control = {"control_generation": self.control.generation} if self.control is not None else {}
        return {**self.gate.counters(), **control, "mode": "true-off", "plain_steps": self.plain_steps,
                "original_steps": self.original_steps, "catchups": self.catchups, "flushes": self.flushes,
                "caught_up_tokens": self.caught_up_tokens,
                "accept_length_on": round(t / n, 4) if n else None, "accept_length_resumed": rate["resumed"],
                "accept_length_steady": rate["steady"], "verify_request_steps_on": n, "accepted_tokens_on": t,
                "verify_request_steps_resumed": self.accept["resumed"][0],
                "accepted_tokens_resumed": self.accept["resumed"][1],
                "sync_free_resolves": self.sync_free_resolves, "mirror_checks": self.mirror_checks,
                "released": self.released, "trimmed_requests": self.trimmed_requests,
                "trimmed_tokens": self.trimmed_tokens, "buffer_rows": self.buffers.rows,
                "buffer_mib": round(self.buffers.nbytes / 2**20, 1),
                "step_counters": {k: list(v) for k, v in self.step_counters.items()},
                "adapter": getattr(getattr(self, "adapter", None), "LINE", None)}  # fmt: skip

    def write_stats(self) -> None:
        if self.stats_path is None:
            return
        try:  # counters are evidence, never a reason to stop serving
            self.stats_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.stats_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.counters()))
            tmp.replace(self.stats_path)
        except OSError as e:
            log.warning("specgate: cannot write gate stats to %s: %s", self.stats_path, e)
            self.stats_path = None


_ACTIVE: TrueOffGate | None = None  # this process's armed gate (one EAGLE worker per scheduler process)


def _slots_cpu(batch, slot_of) -> np.ndarray:
    slots = getattr(batch, "req_pool_indices_cpu", None)
    if slots is None:
        return np.asarray([slot_of(r) for r in batch.reqs], dtype=np.int64)
    return slots.numpy() if isinstance(slots, torch.Tensor) else np.asarray(slots, dtype=np.int64)


def _has_bonus(batch) -> bool:
    spec = batch.spec_info
    return spec is not None and getattr(spec, "bonus_tokens", None) is not None and getattr(spec, "topk_p", None) is not None


def unsupported(worker, settings: dict | None, adapter) -> str | None:
    """Server settings and targets the off path does not handle; None if all is well."""
    sa = adapter.server_args(worker)
    auto = (settings or {}).get("auto") is not None
    checks = [
        (getattr(sa, "disaggregation_mode", "null") != "null", "PD disaggregation (decode slots arrive without a prefill)"),
        (getattr(sa, "enable_streaming_session", False), "streaming sessions (a slot outlives its request)"),
        (getattr(sa, "enable_memory_saver", False), "the memory saver (releases and recaptures graphs)"),
        *adapter.target_checks(worker),
        (getattr(worker, "adaptive_controller", None) is not None,
         "--speculative-adaptive is set (the true-off gate replaces it)"),
        (getattr(sa, "speculative_eagle_topk", 1) != 1, "speculative_eagle_topk != 1"),
        (getattr(sa, "pp_size", 1) > 1, "pipeline parallelism"),
        (getattr(sa, "enable_dp_attention", False), "DP attention"),
        (getattr(sa, "enable_mixed_chunk", False), "mixed chunked prefill"),
        (getattr(sa, "enable_lora", False), "LoRA"),
        (getattr(sa, "enable_two_batch_overlap", False), "two-batch overlap"),
        (getattr(sa, "speculative_use_rejection_sampling", False), "rejection sampling"),
        (getattr(sa, "enable_pdmux", False), "PD multiplexing"),
        (not worker.speculative_algorithm.is_eagle3(), "an algorithm other than EAGLE3"),
        # every rank must take the same path each step; the auto gate decides from the rank's own timings
        (auto and getattr(sa, "tp_size", 1) > 1, "the auto gate with tensor parallelism (each rank would decide alone)"),
    ]
    return next((why for bad, why in checks if bad), None)


def make_hooks(settings: dict, adapter) -> dict:
    """AROUND hooks, keyed by the adapter's targets: the parts every release shares, and the adapter's own."""

    def init_cuda_graphs(original, self, *args, **kwargs):
        global _ACTIVE
        result = original(self, *args, **kwargs)
        why = unsupported(self, settings, adapter)
        if why:
            _say(f"specgate true-off gate refused: {why}; SGLang runs unchanged (always speculating)")
            return result
        self.__dict__["_specgate_trueoff"] = _ACTIVE = TrueOffGate(self, settings, adapter)
        return result

    def forward_batch_generation(original, self, batch, *args, **kwargs):
        state = self.__dict__.get("_specgate_trueoff")
        if state is None:
            return original(self, batch, *args, **kwargs)
        named = dict(zip(adapter.FORWARD_PARAMS, args, strict=False), **kwargs)  # this release's extra parameters, by name
        return state.forward(original, batch, named.pop("on_publish", None), **named)

    def resolve_spec_tokens(original, self, result, batch, *args, **kwargs):
        off = getattr(result, "_specgate_off", False)
        before = [(r.spec_verify_ct, len(r.spec_correct_drafts_histogram)) for r in batch.reqs] if off else None
        out = original(self, result, batch, *args, **kwargs)
        if off:  # SGLang counted a verify step with 0 correct drafts per request: a plain step is neither
            for r, (verify_ct, hist_len) in zip(batch.reqs, before, strict=True):
                if r.spec_verify_ct > verify_ct:
                    r.spec_verify_ct = verify_ct
                    r.spec_correct_drafts_histogram[0] -= 1
                    del r.spec_correct_drafts_histogram[hist_len:]
        state = getattr(self.model_worker, "__dict__", {}).get("_specgate_trueoff")
        if state is not None:
            state.count_accepted(result, batch)
        return out

    def spec_decoding_metrics(original, self, meta_info, recv_obj, i, *args, **kwargs):
        # SGLang divides all completion tokens by the verify steps; with plain steps left out of those,
        # the accept length of the speculative steps is 1 + correct drafts per verify step
        out = original(self, meta_info, recv_obj, i, *args, **kwargs)
        if meta_info.get("spec_verify_ct"):
            meta_info["spec_accept_length"] = 1 + meta_info["spec_num_correct_drafts"] / meta_info["spec_verify_ct"]
        return out

    def free_slot(original, self, req, *args, **kwargs):
        if _ACTIVE is not None and self is _ACTIVE.req_to_token_pool:
            _ACTIVE.release(adapter.slot_of(req))
        return original(self, req, *args, **kwargs)

    def init_decode_cuda_graph(original, self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if _ACTIVE is not None and self is _ACTIVE.target_mr:
            _ACTIVE.recapture()
        return out

    def resolve_seq_lens_cpu(original, self, batch, *args, **kwargs):
        # one scheduler process serves one worker, so the process's gate is the one to ask
        if _ACTIVE is not None and _ACTIVE.resolve_seq_lens(self, batch):
            return None
        return original(self, batch, *args, **kwargs)

    def get_internal_state(original, self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if _ACTIVE is not None and isinstance(getattr(out, "internal_state", None), dict):
            out.internal_state[INFO_KEY] = _ACTIVE.counters()
        return out

    shared = {"init_cuda_graphs": init_cuda_graphs, "forward_batch_generation": forward_batch_generation,
              "resolve_spec_tokens": resolve_spec_tokens, "spec_decoding_metrics": spec_decoding_metrics,
              "free_slot": free_slot, "init_decode_cuda_graph": init_decode_cuda_graph,
              "get_internal_state": get_internal_state}  # fmt: skip
    if settings.get("sync_free_seq_lens", True):
        shared["resolve_seq_lens_cpu"] = resolve_seq_lens_cpu
    hooks = {adapter.TARGETS[key]: hook for key, hook in shared.items()}
    hooks.update(adapter.release_hooks(active))
    return hooks


def active() -> TrueOffGate | None:
    """This process's armed gate, or None."""
    return _ACTIVE


def _say(msg: str) -> None:
    say(logging.INFO, msg)
