"""The true-off gate inside SGLang 0.5.15's EAGLE-3 worker, through the plugin hook API.

SGLang's own way to stop drafting (an adaptive tier with 0 steps) still runs every decode
step as a speculative one: the target in verify mode with its verify kernels, the draft
extend, and the spec-v2 bookkeeping (docs/design/true-off-gate.md). While the specgate
gate is off, this module runs the step the way a no-speculation server does instead:

  the target in DECODE mode, replaying a plain decode CUDA graph captured at startup on its
  own attention backend, and the target's ordinary sampler; no draft forward and no draft
  extend. The target's three aux hidden states of each new token are buffered per request
  (`specgate.sglang.aux_buffers.AuxBuffers`).

When the gate turns back on, one batched draft extend over each request's buffered tokens
(SGLang's own `_draft_extend_for_prefill`) writes the draft KV the off steps skipped and
yields the draft state that drafting resumes from. While off, once any request's buffer
fills up (W tokens), every buffer in the batch is flushed the same way. Requests admitted
while off get their draft KV from the prefill, as always.

The hooks (AROUND each; no SGLang file edited):
  EAGLEWorkerV2.init_cuda_graphs             build the decode graph, backend and buffers
  EAGLEWorkerV2.forward_batch_generation     the gate, the off step, the catch-up
  SchedulerBatchResultProcessor._resolve_spec_v2_tokens
                                             acceptance of the speculative steps alone, and an off
                                             step left out of each request's verify count
  TokenizerManager._calculate_spec_decoding_metrics
                                             a request's accept length from its verify steps alone
  Req._cache_commit_len                      a request finishing with buffered tokens leaves them out
                                             of the prefix cache (their draft KV was never written)
  ReqToTokenPool.free                        a released slot starts clean, prefill or not
  ModelRunner.init_decode_cuda_graph         a weight update's recapture recaptures the plain graph
  Scheduler.get_internal_state               the gate's counters in /server_info, so a benchmark can
                                             take exact per-level deltas
  FutureMap.resolve_seq_lens_cpu             (sync-free lengths, the default) after a prefill or a
                                             gate-off step the host knows every length, so backends
                                             that want host lengths (flashinfer) skip spec v2's
                                             per-step device-to-host sync; "check_mirror_every": N
                                             compares the mirror with the device every N steps and
                                             stops the server on a difference

The off step returns a spec-v2 result with one token per request (stride 1, accept length
1), so the scheduler, the KV accounting and the overlap future map work unchanged. Rows with
the speculative path's extras take the off step too: logprobs come from SGLang's own spec-v2
logprob code over the plain logits, grammars mask the target's sampler as in a plain decode
and advance in the result processor, and returned hidden states are the step's aux rows.

The module is written against SGLang 0.5.15 exactly: `contract_mismatch()` reads the
installed SGLang's source (no import) and names the first internal that differs; the
plugin then refuses the mode and leaves SGLang unchanged.
"""

from __future__ import annotations

import ast
import copy
import importlib.metadata
import importlib.util
import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch

from specgate.gate import RESUMED_STEPS, make_gate
from specgate.gate_control import GateControl
from specgate.sglang.aux_buffers import AuxBuffers, upload
from specgate.sglang.logs import log, say
from specgate.sglang.step_timer import StepTimer

SUPPORTED_VERSION = "0.5.15"
WORKER = "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2"
RESULTS = "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"
FUTURE_MAP = "sglang.srt.managers.overlap_utils.FutureMap"
SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
TOKENIZER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
REQ = "sglang.srt.managers.schedule_batch.Req"
REQ_POOL = "sglang.srt.mem_cache.memory_pool.ReqToTokenPool"
MODEL_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
INFO_KEY = "specgate_gate"  # the gate's counters in /server_info's internal_states
LOG_EVERY = 2000  # decode steps between counter lines
SLOW_FACTOR, MAX_STEP_NOTES = 4.0, 400  # note_time: a slow step, and the most lines it writes
STATS_ENV = "SPECGATE_STATS_DIR"  # if set, rank 0 keeps its counters in a JSON file there

# file (under sglang/srt) -> class -> member -> its parameter names, exactly (None: must exist)
CONTRACT = {
    "speculative/eagle_worker_v2.py": {
        "EAGLEWorkerV2": {
            "forward_batch_generation": ["self", "batch", "on_publish"],
            "init_cuda_graphs": ["self"],
            "war_fastpath_runner": None,
            "adaptive_controller": None,
            "speculative_algorithm": None,
            "server_args": None,
        },
        "EagleDraftWorker": {
            "_draft_extend_for_prefill": ["self", "batch", "target_hidden_states", "next_token_ids", "mm_input_embeds"],
            "draft_tp_context": None,
            "draft_runner": None,
        },
        None: {"speculative_moe_backend_context": None, "speculative_moe_a2a_backend_context": None},
    },
    "model_executor/forward_batch_info.py": {"ForwardBatch": {"init_new": ["cls", "batch", "model_runner"]}},
    "layers/utils/logprob.py": {
        None: {"compute_spec_v2_logprobs": ["batch", "logits_output", "predict", "accept_index", "speculative_num_steps"]},
    },
    "managers/schedule_batch.py": {"Req": {"_cache_commit_len": ["self"], "pop_committed_kv_cache": ["self"],
                                           "pop_overallocated_kv_cache": ["self"]}},  # fmt: skip
    "mem_cache/common.py": {None: {"release_kv_cache": ["req", "tree_cache", "is_insert"]}},
    "mem_cache/memory_pool.py": {"ReqToTokenPool": {"free": ["self", "req"], "req_to_token": None}},
    "managers/tokenizer_manager.py": {
        "TokenizerManager": {"_calculate_spec_decoding_metrics": ["self", "meta_info", "recv_obj", "i"]},
    },
    "managers/scheduler.py": {"Scheduler": {"get_internal_state": ["self", "recv_req"]}},
    "model_executor/runner/decode_cuda_graph_runner.py": {
        "DecodeCudaGraphRunner": {
            "__init__": ["self", "model_runner", "attn_backend", "speculative_num_steps", "speculative_num_draft_tokens"],
            "capture": ["self"],
            "get_spec_info": ["self", "num_tokens"],
            "execute": ["self", "forward_batch", "pp_proxy_tensors"],
        },
    },
    "model_executor/model_runner.py": {
        "ModelRunner": {
            "_get_attention_backend": ["self", "init_new_workspace"],
            "init_decode_cuda_graph": ["self"],
            "war_fastpath_read_done_event": None,
            "decode_cuda_graph_runner": None,
            "attn_backend": None,
            "init_new_workspace": None,
            "req_to_token_pool": None,
            "mambaish_config": None,
            "model_is_mrope": None,
            "is_hybrid_swa": None,
            "sliding_window_size": None,
            "use_mla_backend": None,
        },
    },
    "managers/tp_worker.py": {
        "TpModelWorker": {
            "forward_batch_generation": ["self", "batch", "forward_batch", "pp_proxy_tensors", "is_verify",
                                         "skip_attn_backend_init"],
        },
    },
    "speculative/eagle_utils.py": {
        None: {
            "get_draft_input_from_target_hidden_dim": ["model_runner"],
            "_eagle_prefill_tail_tokens": ["batch", "next_token_ids"],
        },
    },
    "managers/scheduler_components/batch_result_processor.py": {
        "SchedulerBatchResultProcessor": {"_resolve_spec_v2_tokens": ["self", "result", "batch"]},
    },
    "managers/overlap_utils.py": {
        "FutureMap": {"resolve_seq_lens_cpu": ["self", "batch"], "publish": ["self", "future_indices", "new_seq_lens"],
                      "needs_cpu_seq_lens": None, "publish_ready": None, "new_seq_lens_buf": None},
    },
}
# dataclass fields the off step and the catch-up construct or read
FIELDS = {
    "managers/utils.py": {
        "GenerationBatchResult": [
            "logits_output",
            "next_token_ids",
            "can_run_cuda_graph",
            "speculative_num_draft_tokens",
            "accept_lens",
            "new_seq_lens",
            "next_draft_input",
            "extra_keep_alive_refs",
        ],  # fmt: skip
    },
    "speculative/eagle_info.py": {
        "EagleDraftInput": ["topk_p", "topk_index", "hidden_states", "bonus_tokens", "num_tokens_per_req", "future_indices"],
    },
    "managers/schedule_batch.py": {
        "ScheduleBatch": [
            "reqs",
            "req_pool_indices",
            "req_pool_indices_cpu",
            "seq_lens",
            "seq_lens_cpu",
            "seq_lens_sum",
            "orig_seq_lens",
            "out_cache_loc",
            "input_ids",
            "extend_lens",
            "prefix_lens",
            "extend_num_tokens",
            "extend_logprob_start_lens",
            "chunked_req_next_prompt_token",
            "return_logprob",
            "has_grammar",
            "return_hidden_states",
            "spec_info",
            "capture_hidden_mode",
            "sampling_info",
            "top_logprobs_nums",
            "token_ids_logprobs",
        ],  # fmt: skip
        "Req": ["req_pool_idx", "kv_committed_len", "cache_protected_len", "spec_verify_ct",
                "spec_correct_drafts_histogram"],  # fmt: skip
    },
}


def sglang_source_dir() -> Path | None:
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None or not spec.submodule_search_locations:  # None: a bare folder named sglang
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "srt"


def _installed_version(srt_dir: Path) -> str | None:
    """The version of the SGLang whose sources are at `srt_dir`, from its dist-info beside it."""
    for info in sorted(srt_dir.parent.parent.glob("sglang-*.dist-info")):
        return info.name[len("sglang-") : -len(".dist-info")]
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def _members(tree: ast.Module) -> dict:
    """class name (None for module level) -> {member: parameter names or [] for attributes}."""
    out: dict = {None: {}}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[None][node.name] = _params(node)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):  # names the module imports are its members too
            out[None].update((a.asname or a.name.split(".")[0], []) for a in node.names)
        elif isinstance(node, ast.ClassDef):
            members = out.setdefault(node.name, {})
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    members[item.name] = _params(item)
                    for attr in _self_attributes(item):  # instance attributes: self.x = ... in any method
                        members.setdefault(attr, [])
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    members[item.target.id] = []
    return out


def _self_attributes(fn) -> set[str]:
    names = set()
    for node in ast.walk(fn):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for t in targets:
            for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) and el.value.id == "self":
                    names.add(el.attr)
    return names


def _params(fn) -> list[str]:
    a = fn.args
    return [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]


def version_supported(version: str | None) -> bool:
    """0.5.15 and its post-releases (0.5.15.post1, ...): the same source tree, by PEP 440's rules."""
    from packaging.version import InvalidVersion, Version

    try:
        v = Version(version or "")
    except InvalidVersion:
        return False
    return v.release == Version(SUPPORTED_VERSION).release and v.pre is None and v.dev is None and v.local is None


def contract_mismatch(srt_dir: Path | None = None, version: str | None = None) -> str | None:
    """None if the SGLang at `srt_dir` has every internal this module uses; else the first difference."""
    srt_dir = srt_dir or sglang_source_dir()
    if srt_dir is None:
        return "SGLang is not installed"
    if version is None:
        version = _installed_version(srt_dir)
    if not version_supported(version):
        return f"SGLang {version} is not {SUPPORTED_VERSION}, the version the true-off adapter was written against"
    wanted: dict = {}
    for table in (CONTRACT, FIELDS):
        for rel, classes in table.items():
            for cls, members in classes.items():
                spec = members if isinstance(members, dict) else dict.fromkeys(members)
                wanted.setdefault(rel, {}).setdefault(cls, {}).update(spec)
    for rel, classes in wanted.items():
        path = srt_dir / rel
        if not path.exists():
            return f"{path} is missing"
        found = _members(ast.parse(path.read_text(), str(path)))
        for cls, members in classes.items():
            if cls not in found:
                return f"{rel}: class {cls} is missing"
            for name, params in members.items():
                where = f"{rel}: {cls + '.' if cls else ''}{name}"
                if name not in found[cls]:
                    return f"{where} is missing"
                # exactly these parameters: a new one (0.5.23's grammar_barrier) is a new duty the hook would skip
                if params and found[cls][name] != params:
                    return f"{where} takes {found[cls][name]}, expected {params}"
    return None


def make_plain_decode_runner(model_runner, attn_backend):
    """A DecodeCudaGraphRunner that captures plain DECODE (1 token per request) with full aux capture.

    Inside an EAGLE server SGLang captures the target only in TARGET_VERIFY mode; this subclass
    switches the mode back before capture, as SGLang's own draft-extend runner does for its mode.
    """
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    class PlainDecodeRunner(DecodeCudaGraphRunner):
        def capture(self):
            self.capture_forward_mode = ForwardMode.DECODE
            self.capture_hidden_mode = CaptureHiddenMode.FULL  # the aux states ride along
            return super().capture()

        def get_spec_info(self, num_tokens):
            return None

        def recapture_if_needed(self, forward_batch):
            return None  # every off batch asks for FULL, which is what was captured

    return PlainDecodeRunner(model_runner, attn_backend=attn_backend, speculative_num_steps=0, speculative_num_draft_tokens=1)


class TrueOffGate:
    """The gate and the off path of one EAGLEWorkerV2 (one per TP rank)."""

    def __init__(self, worker, settings: dict):
        from sglang.srt.speculative.eagle_utils import get_draft_input_from_target_hidden_dim

        self.worker = worker
        self.target_mr = mr = worker.target_worker.model_runner
        self.draft_runner = worker.draft_worker.draft_runner
        before = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0
        tic = time.perf_counter()
        backup = mr.init_new_workspace
        try:  # a backend of its own: graph capture allocates the backend's static buffers
            self.attn_backend = mr._get_attention_backend(init_new_workspace=True)
        finally:
            mr.init_new_workspace = backup
        self.graph_runner = None
        if mr.decode_cuda_graph_runner is not None:
            self.graph_runner = make_plain_decode_runner(mr, self.attn_backend)
        self.req_to_token_pool = mr.req_to_token_pool
        self.req_to_token = mr.req_to_token_pool.req_to_token
        aux_dim = get_draft_input_from_target_hidden_dim(self.draft_runner)
        self.init_state(settings, self.req_to_token.shape[0], aux_dim, mr.model_config.dtype, mr.device,
                        rank=getattr(worker, "tp_rank", 0))  # fmt: skip
        used = (before - torch.cuda.mem_get_info()[0]) / 2**30 if torch.cuda.is_available() else 0.0
        b = self.buffers
        _say(f"specgate true-off armed: plain decode graph bs={getattr(self.graph_runner, 'capture_bs', None)}, "
             f"aux buffers {b.tokens.shape[0]}x{b.window}x{aux_dim} ({b.nbytes / 2**20:.1f} MiB), "
             f"{used:.2f} GB in {time.perf_counter() - tic:.1f} s; sync-free seq_lens {self.sync_free}; "
             f"gate {self.gate.counters()} (pid {os.getpid()})")  # fmt: skip

    def init_state(self, settings: dict, pool: int, aux_dim: int, dtype, device, rank: int = 0) -> None:
        """Everything but the SGLang objects: the gate, the buffers, the host mirror, the counters."""
        self.gate = make_gate(settings)  # a fixed threshold, or the auto gate (settings["auto"])
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
        slots = _slots_cpu(batch)
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

    def forward(self, original, batch, on_publish):
        worker = self.worker
        if batch.forward_mode.is_extend() or batch.is_extend_in_batch:
            out = original(worker, batch, on_publish)
            slots_cpu = _slots_cpu(batch)
            if slots_cpu.size:  # new requests: the prefill built their draft KV
                self.buffers.reset(slots_cpu)
                self._mirror(slots_cpu, batch.seq_lens_cpu, 0)  # spec v2: length before the first decode token
            return out
        if batch.forward_mode.is_idle() or not batch.reqs:
            return original(worker, batch, on_publish)
        # the auto gate's step times: steps timed on the device, fed in once they have completed (the
        # tokens of a speculative step arrive in count_accepted)
        for running, speculated, probe, seconds in self.timer.finished():
            self.note_time(running, speculated, seconds)
            if seconds is not None:
                c = self.step_counters["spec" if speculated else "plain"]
                c[0], c[1], c[3] = c[0] + 1, c[1] + running, c[3] + seconds
                c[2] += 0 if speculated else running
            self.gate.observe_time(running, speculated, seconds, probe=probe)
        if self.control is not None:
            self.gate = self.control.poll()
        before = self.gate.switches
        on = self.gate.decide(len(batch.reqs))
        plain_ok = _has_bonus(batch)  # False only before a request's first draft state exists
        if self.gate.switches != before or (self.gate.steps_on + self.gate.steps_off) % LOG_EVERY == 0:
            log.info("specgate gate %s at batch %d: %s", "on" if on else "off", len(batch.reqs), json.dumps(self.counters()))
            self.write_stats()
        speculate = on or not plain_ok
        self.timer.begin(len(batch.reqs), speculate, self.gate.probing)
        out = self.decode_step(original, batch, on_publish, speculate)
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

    def decode_step(self, original, batch, on_publish, speculate: bool):
        slots_cpu = _slots_cpu(batch)
        if speculate:
            if self.buffers.pending(slots_cpu):
                self.catch_up(batch, slots_cpu, resume=True)
                self.timer.untypical()  # its time is the catch-up's as much as the step's
                self.since_catchup = 0
            self.original_steps += 1
            self.len_ok[slots_cpu] = False  # the accept lengths reach the host only later
            out = original(self.worker, batch, on_publish)
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
        return self.plain_step(batch, slots_cpu, on_publish)

    def plain_step(self, batch, slots_cpu, on_publish):
        """One decode step of the target alone, in the result format of a spec-v2 step."""
        from sglang.srt.managers.utils import GenerationBatchResult
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
        from sglang.srt.speculative.eagle_info import EagleDraftInput

        mr, bs = self.target_mr, len(batch.reqs)
        draft_input = batch.spec_info
        tokens = draft_input.bonus_tokens.to(torch.int64)
        # spec v2 keeps seq_lens = length before this step's token; a decode batch counts it
        view = copy.copy(batch)
        view.forward_mode = ForwardMode.DECODE
        view.spec_info = None
        view.capture_hidden_mode = CaptureHiddenMode.FULL
        view.input_ids = tokens
        view.return_logprob = False  # logprobs below, in the speculative path's row layout
        view.out_cache_loc = self.req_to_token[batch.req_pool_indices, batch.seq_lens].to(torch.int64)
        view.seq_lens = batch.seq_lens + 1
        view.orig_seq_lens = view.seq_lens.to(torch.int32)
        view.seq_lens_cpu = batch.seq_lens_cpu + 1 if batch.seq_lens_cpu is not None else None
        view.seq_lens_sum = batch.seq_lens_sum + bs if batch.seq_lens_sum is not None else None
        view.seq_lens_cpu_cache = None

        saved = mr.attn_backend, mr.decode_cuda_graph_runner
        mr.attn_backend, mr.decode_cuda_graph_runner = self.attn_backend, self.graph_runner
        try:
            forward_batch = ForwardBatch.init_new(view, mr)
            out = self.worker.target_worker.forward_batch_generation(batch=None, forward_batch=forward_batch)
        finally:
            mr.attn_backend, mr.decode_cuda_graph_runner = saved
        # the scheduler's write-after-read barrier waits on the draft runner's event (spec v2)
        event = getattr(mr, "war_fastpath_read_done_event", None)
        if event is not None:
            self.draft_runner.war_fastpath_read_done_event = event
            mr.war_fastpath_read_done_event = None

        new_seq_lens = view.seq_lens
        if on_publish is not None:
            on_publish(new_seq_lens)
        logits_output = out.logits_output
        if logits_output.hidden_states is None:
            raise RuntimeError("specgate true-off: the target returned no aux hidden states in DECODE mode")
        self.buffers.append(slots_cpu, tokens, logits_output.hidden_states)
        if not batch.return_hidden_states:  # else one row per request, as a speculative step returns them
            logits_output.hidden_states = None
        next_ids = out.next_token_ids
        if batch.return_logprob:  # SGLang's own spec-v2 logprobs: [bs, accepted] rows, here one token each
            from sglang.srt.layers.utils.logprob import compute_spec_v2_logprobs

            accept_index = torch.arange(bs, device=next_ids.device).view(bs, 1)
            compute_spec_v2_logprobs(batch, logits_output, next_ids, accept_index, 0)
        # draft fields pass through untouched: they are stale until the catch-up rewrites them
        next_draft_input = EagleDraftInput(
            bonus_tokens=next_ids.to(torch.int32), topk_p=draft_input.topk_p, topk_index=draft_input.topk_index,
            hidden_states=draft_input.hidden_states, num_tokens_per_req=1, num_tokens_for_logprob_per_req=1)  # fmt: skip
        result = GenerationBatchResult(
            logits_output=logits_output, next_token_ids=next_ids, can_run_cuda_graph=out.can_run_cuda_graph,
            speculative_num_draft_tokens=1, accept_lens=self.ones[:bs], new_seq_lens=new_seq_lens,
            next_draft_input=next_draft_input, extra_keep_alive_refs=[forward_batch, tokens])  # fmt: skip
        result._specgate_off = True  # the scheduler's per-request metrics leave this step out
        return result

    def catch_up(self, batch, slots_cpu, resume: bool) -> None:
        """One draft extend over the buffered tokens of the rows behind. resume: drafting starts from
        these rows' fresh draft state (a flush while off discards it)."""
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang.srt.speculative import eagle_worker_v2 as ew2

        plan = self.buffers.plan(slots_cpu, self.host_seq_lens(batch, slots_cpu))
        if plan is None:
            return
        device = batch.seq_lens.device
        sel = upload(plan.sel, device)
        input_ids, aux, out_cache_loc = self.buffers.gather(plan, self.req_to_token)

        sub = copy.copy(batch)
        sub.forward_mode = ForwardMode.EXTEND
        sub.reqs = [batch.reqs[i] for i in plan.sel]
        sub.req_pool_indices = batch.req_pool_indices[sel]
        sub.req_pool_indices_cpu = torch.from_numpy(plan.slots)
        sub.seq_lens = batch.seq_lens[sel]
        sub.orig_seq_lens = sub.seq_lens.to(torch.int32)
        sub.seq_lens_cpu = torch.from_numpy(plan.seq_lens)
        sub.seq_lens_sum = int(plan.seq_lens.sum())
        sub.seq_lens_cpu_cache = None
        sub.input_ids, sub.out_cache_loc = input_ids, out_cache_loc.to(torch.int64)
        sub.extend_lens = plan.counts.tolist()
        sub.prefix_lens = plan.starts.tolist()
        sub.extend_num_tokens = plan.total
        sub.extend_logprob_start_lens = plan.counts.tolist()
        sub.extend_input_logprob_token_ids = None
        sub.chunked_req_next_prompt_token = None
        sub.multimodal_inputs = None
        sub.input_embeds = sub.replace_embeds = None
        sub.return_logprob, sub.top_logprobs_nums, sub.token_ids_logprobs = False, None, None
        sub.return_hidden_states = False
        sub.spec_info = None
        sub.sampling_info = None  # the draft extend only takes a softmax (no rejection sampling)
        sub.capture_hidden_mode = None

        draft_worker = self.worker.draft_worker
        with (
            draft_worker.draft_tp_context(draft_worker.draft_runner.tp_group),
            ew2.speculative_moe_backend_context(),
            ew2.speculative_moe_a2a_backend_context(),
        ):
            nxt = batch.spec_info.bonus_tokens[sel]
            fresh = draft_worker._draft_extend_for_prefill(sub, aux, nxt)
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

    def commit_len(self, req, committed: int) -> int:
        """How much of a finishing request the prefix cache may keep: up to its first token whose draft
        KV an off step skipped. The rest is freed with the request (SGLang's own route for KV it does
        not keep), so a later prefix hit re-prefills those few tokens instead of drafting on stale KV."""
        slot = req.req_pool_idx
        n = int(self.buffers.n_cpu[slot]) if slot is not None else 0
        if n == 0:
            return committed
        # at least one token past the prefix the cache already holds: SGLang frees a finishing request's
        # last committed token itself (EAGLE's radix keys are bigrams), which must not be one the cache owns
        keep = min(committed, max(committed - n, req.cache_protected_len + 1))
        if not req.kv_overallocated_freed:  # asked twice per release (committed, then over-allocated)
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
            self.graph_runner = make_plain_decode_runner(self.target_mr, self.attn_backend)
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
                "step_counters": {k: list(v) for k, v in self.step_counters.items()}}  # fmt: skip

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


def _slots_cpu(batch) -> np.ndarray:
    slots = getattr(batch, "req_pool_indices_cpu", None)
    if slots is None:
        return np.asarray([r.req_pool_idx for r in batch.reqs], dtype=np.int64)
    return slots.numpy() if isinstance(slots, torch.Tensor) else np.asarray(slots, dtype=np.int64)


def _has_bonus(batch) -> bool:
    spec = batch.spec_info
    return spec is not None and getattr(spec, "bonus_tokens", None) is not None and getattr(spec, "topk_p", None) is not None


def unsupported(worker, settings: dict | None = None) -> str | None:
    """Server settings and targets the off path does not handle; None if all is well."""
    sa = worker.server_args
    auto = (settings or {}).get("auto") is not None
    mr = worker.target_worker.model_runner
    checks = [
        (getattr(sa, "disaggregation_mode", "null") != "null", "PD disaggregation (decode slots arrive without a prefill)"),
        (getattr(sa, "enable_streaming_session", False), "streaming sessions (a slot outlives its request)"),
        (getattr(sa, "enable_memory_saver", False), "the memory saver (releases and recaptures graphs)"),
        (getattr(mr, "mambaish_config", None) is not None, "a hybrid linear-attention target (mamba/GDN)"),
        (getattr(mr, "is_hybrid_swa", False) or getattr(mr, "sliding_window_size", None) is not None,
         "a sliding-window attention target"),
        (getattr(mr, "model_is_mrope", False), "an mrope target"),
        (getattr(getattr(mr, "model_config", None), "is_multimodal", False), "a multimodal target"),
        (getattr(mr, "use_mla_backend", False), "an MLA target (DeepSeek-style attention, DSA included)"),
        (worker.adaptive_controller is not None, "--speculative-adaptive is set (the true-off gate replaces it)"),
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


def make_hooks(settings: dict):
    """AROUND hooks for EAGLEWorkerV2.init_cuda_graphs, .forward_batch_generation and the result processor."""

    def init_cuda_graphs(original, self, *args, **kwargs):
        global _ACTIVE
        result = original(self, *args, **kwargs)
        why = unsupported(self, settings)
        if why:
            _say(f"specgate true-off gate refused: {why}; SGLang runs unchanged (always speculating)")
            return result
        self.__dict__["_specgate_trueoff"] = _ACTIVE = TrueOffGate(self, settings)
        return result

    def forward_batch_generation(original, self, batch, on_publish=None):
        state = self.__dict__.get("_specgate_trueoff")
        if state is None:
            return original(self, batch, on_publish)
        return state.forward(original, batch, on_publish)

    def resolve_spec_v2_tokens(original, self, result, batch, *args, **kwargs):
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

    def spec_decoding_metrics(original, self, meta_info, recv_obj, i):
        # SGLang divides all completion tokens by the verify steps; with plain steps left out of those,
        # the accept length of the speculative steps is 1 + correct drafts per verify step
        out = original(self, meta_info, recv_obj, i)
        if meta_info.get("spec_verify_ct"):
            meta_info["spec_accept_length"] = 1 + meta_info["spec_num_correct_drafts"] / meta_info["spec_verify_ct"]
        return out

    def cache_commit_len(original, self):
        committed = original(self)
        return _ACTIVE.commit_len(self, committed) if _ACTIVE is not None else committed

    def free_slot(original, self, req):
        if _ACTIVE is not None and self is _ACTIVE.req_to_token_pool:
            _ACTIVE.release(req.req_pool_idx)
        return original(self, req)

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

    hooks = {f"{WORKER}.init_cuda_graphs": init_cuda_graphs, f"{WORKER}.forward_batch_generation": forward_batch_generation,
             f"{RESULTS}._resolve_spec_v2_tokens": resolve_spec_v2_tokens,
             f"{SCHEDULER}.get_internal_state": get_internal_state,
             f"{TOKENIZER}._calculate_spec_decoding_metrics": spec_decoding_metrics,
             f"{REQ}._cache_commit_len": cache_commit_len, f"{REQ_POOL}.free": free_slot,
             f"{MODEL_RUNNER}.init_decode_cuda_graph": init_decode_cuda_graph}  # fmt: skip
    if settings.get("sync_free_seq_lens", True):
        hooks[f"{FUTURE_MAP}.resolve_seq_lens_cpu"] = resolve_seq_lens_cpu
    return hooks


def _say(msg: str) -> None:
    say(logging.INFO, msg)
