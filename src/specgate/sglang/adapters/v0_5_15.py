"""The true-off gate's adapter for SGLang 0.5.15 (and its post-releases): what touches SGLang's objects.

The hooks (AROUND each; no SGLang file edited):
  EAGLEWorkerV2.init_cuda_graphs             arm: build the plain decode graph, backend and buffers
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
  Scheduler.get_internal_state               the gate's counters in /server_info
  FutureMap.resolve_seq_lens_cpu             sync-free lengths after a prefill or a gate-off step
"""

from __future__ import annotations

import copy

import torch

LINE = "SGLang 0.5.15"
RELEASES = ("0.5.15", "0.5.15.post1")  # checked against these sources
WORKER = "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2"
TARGETS = {
    "init_cuda_graphs": f"{WORKER}.init_cuda_graphs",
    "forward_batch_generation": f"{WORKER}.forward_batch_generation",
    "resolve_spec_tokens": "sglang.srt.managers.scheduler_components.batch_result_processor."
                           "SchedulerBatchResultProcessor._resolve_spec_v2_tokens",
    "spec_decoding_metrics": "sglang.srt.managers.tokenizer_manager.TokenizerManager._calculate_spec_decoding_metrics",
    "free_slot": "sglang.srt.mem_cache.memory_pool.ReqToTokenPool.free",
    "init_decode_cuda_graph": "sglang.srt.model_executor.model_runner.ModelRunner.init_decode_cuda_graph",
    "get_internal_state": "sglang.srt.managers.scheduler.Scheduler.get_internal_state",
    "resolve_seq_lens_cpu": "sglang.srt.managers.overlap_utils.FutureMap.resolve_seq_lens_cpu",
}  # fmt: skip
FORWARD_PARAMS = ("on_publish",)  # forward_batch_generation's parameters after `batch`
REQ = "sglang.srt.managers.schedule_batch.Req"

# file (under sglang/srt) -> class (None: module level) -> member -> its parameter names, exactly (None: must exist)
CONTRACT = {
    "speculative/eagle_worker_v2.py": {
        "EAGLEWorkerV2": {
            "forward_batch_generation": ["self", "batch", "on_publish"],
            "init_cuda_graphs": ["self"],
            "war_fastpath_runner": None,
            "adaptive_controller": None,
            "speculative_algorithm": None,
            "server_args": None,
            "target_worker": None,
            "draft_worker": None,
            "tp_rank": None,
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
            "recapture_if_needed": ["self", "forward_batch"],
            "execute": ["self", "forward_batch", "pp_proxy_tensors"],
            "capture_forward_mode": None,
            "capture_hidden_mode": None,
        },
    },
    "model_executor/model_runner.py": {
        "ModelRunner": {
            "_get_attention_backend": ["self", "init_new_workspace"],
            "init_decode_cuda_graph": ["self"],
            "sample": ["self", "logits_output", "forward_batch"],
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
            "model_config": None,
            "device": None,
        },
    },
    "managers/tp_worker.py": {
        "TpModelWorker": {
            "forward_batch_generation": ["self", "batch", "forward_batch", "pp_proxy_tensors", "is_verify",
                                         "skip_attn_backend_init"],
            "model_runner": None,
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
# dataclass fields and attributes the off step and the catch-up construct or read
FIELDS = {
    "managers/utils.py": {
        "GenerationBatchResult": ["logits_output", "next_token_ids", "can_run_cuda_graph", "speculative_num_draft_tokens",
                                  "accept_lens", "new_seq_lens", "next_draft_input", "extra_keep_alive_refs",
                                  "num_correct_drafts"],  # fmt: skip
    },
    "speculative/eagle_info.py": {
        "EagleDraftInput": ["topk_p", "topk_index", "hidden_states", "bonus_tokens", "num_tokens_per_req",
                            "num_tokens_for_logprob_per_req", "future_indices"],  # fmt: skip
    },
    "managers/schedule_batch.py": {
        "ScheduleBatch": ["reqs", "forward_mode", "is_extend_in_batch", "req_pool_indices", "req_pool_indices_cpu",
                          "seq_lens", "seq_lens_cpu", "seq_lens_sum", "orig_seq_lens", "seq_lens_cpu_cache",
                          "out_cache_loc", "input_ids", "extend_lens", "prefix_lens", "extend_num_tokens",
                          "extend_logprob_start_lens", "extend_input_logprob_token_ids",
                          "chunked_req_next_prompt_token", "multimodal_inputs", "input_embeds", "replace_embeds",
                          "return_logprob", "has_grammar", "return_hidden_states", "spec_info", "capture_hidden_mode",
                          "sampling_info", "top_logprobs_nums", "token_ids_logprobs"],  # fmt: skip
        "Req": ["req_pool_idx", "kv_committed_len", "cache_protected_len", "kv_overallocated_freed", "spec_verify_ct",
                "spec_correct_drafts_histogram"],  # fmt: skip
    },
}


def server_args(worker):
    return worker.server_args


def tp_rank(worker) -> int:
    return getattr(worker, "tp_rank", 0)


def slot_of(req):
    return req.req_pool_idx


def target_checks(worker) -> list:
    """(bad, why) for targets the off path does not handle, read where this release keeps them."""
    mr = worker.target_worker.model_runner
    return [
        (mr.mambaish_config is not None, "a hybrid linear-attention target (mamba/GDN)"),
        (mr.is_hybrid_swa or mr.sliding_window_size is not None, "a sliding-window attention target"),
        (mr.model_is_mrope, "an mrope target"),
        (getattr(mr.model_config, "is_multimodal", False), "a multimodal target"),
        (mr.use_mla_backend, "an MLA target (DeepSeek-style attention, DSA included)"),
    ]


def plain_decode_runner(model_runner, attn_backend, capture_method: str = "capture", recapture: bool = True):
    """A DecodeCudaGraphRunner that captures plain DECODE (1 token per request) with full aux capture.

    Inside an EAGLE server SGLang captures the target only in TARGET_VERIFY mode; this subclass
    switches the mode back before capture, as SGLang's own draft-extend runner does for its mode.
    capture_method: the method that captures (0.5.23 wraps `_capture` in `capture`); recapture: the
    release recaptures on a batch asking for more hidden states (0.5.15), which FULL never does.
    """
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    def capture(self):
        assert getattr(self, "captured_req_width", 1) == 1, "specgate: the plain decode graph is one token wide"
        assert not getattr(self, "ragged_verify_mode", False), "specgate: a ragged verify shape is no plain decode"
        self.capture_forward_mode = ForwardMode.DECODE
        self.capture_hidden_mode = CaptureHiddenMode.FULL  # the aux states ride along
        return getattr(DecodeCudaGraphRunner, capture_method)(self)

    members = {capture_method: capture, "get_spec_info": lambda self, num_tokens: None}
    if recapture:
        members["recapture_if_needed"] = lambda self, forward_batch: None  # every off batch asks for what was captured
    runner = type("PlainDecodeRunner", (DecodeCudaGraphRunner,), members)
    return runner(model_runner, attn_backend=attn_backend, speculative_num_steps=0, speculative_num_draft_tokens=1)


def arm(gate, worker, make_runner=None) -> int:
    """Build the gate's own attention backend and plain decode graph; return the aux state width."""
    from sglang.srt.speculative.eagle_utils import get_draft_input_from_target_hidden_dim

    gate.target_mr = mr = worker.target_worker.model_runner
    gate.draft_runner = worker.draft_worker.draft_runner
    backup = mr.init_new_workspace
    try:  # a backend of its own: graph capture allocates the backend's static buffers
        gate.attn_backend = mr._get_attention_backend(init_new_workspace=True)
    finally:
        mr.init_new_workspace = backup
    make_runner = make_runner or plain_decode_runner
    gate.graph_runner = make_runner(mr, gate.attn_backend) if mr.decode_cuda_graph_runner is not None else None
    gate.req_to_token_pool = mr.req_to_token_pool
    return get_draft_input_from_target_hidden_dim(gate.draft_runner)


def decode_view(gate, batch):
    """The batch as SGLang's plain decode sees it: spec v2 keeps seq_lens = length before this step's
    token; a decode batch counts it. Returns (view, the tokens fed)."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    view, tokens = decode_fields(gate, batch)
    view.capture_hidden_mode = CaptureHiddenMode.FULL
    view.seq_lens_cpu_cache = None
    return view, tokens


def decode_fields(gate, batch):
    """A copy of the batch with the fields every release's plain decode reads; returns (view, tokens)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    bs = len(batch.reqs)
    tokens = batch.spec_info.bonus_tokens.to(torch.int64)
    view = copy.copy(batch)
    view.forward_mode = ForwardMode.DECODE
    view.spec_info = None
    view.input_ids = tokens
    view.return_logprob = False  # logprobs below, in the speculative path's row layout
    view.out_cache_loc = gate.req_to_token[batch.req_pool_indices, batch.seq_lens].to(torch.int64)
    view.seq_lens = batch.seq_lens + 1
    view.orig_seq_lens = view.seq_lens.to(torch.int32)
    view.seq_lens_cpu = batch.seq_lens_cpu + 1 if batch.seq_lens_cpu is not None else None
    view.seq_lens_sum = batch.seq_lens_sum + bs if batch.seq_lens_sum is not None else None
    return view, tokens


def plain_step(gate, batch, slots_cpu, on_publish):
    """One decode step of the target alone, in the result format of a spec-v2 step."""
    from sglang.srt.layers.utils.logprob import compute_spec_v2_logprobs
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.speculative.eagle_info import EagleDraftInput

    mr, bs, draft_input = gate.target_mr, len(batch.reqs), batch.spec_info
    view, tokens = decode_view(gate, batch)
    saved = mr.attn_backend, mr.decode_cuda_graph_runner
    mr.attn_backend, mr.decode_cuda_graph_runner = gate.attn_backend, gate.graph_runner
    try:
        forward_batch = ForwardBatch.init_new(view, mr)
        # the forward alone (as verify runs it): a logprob request's logits are kept before the sampler
        # scales them by the temperature in place
        out = gate.worker.target_worker.forward_batch_generation(batch=None, forward_batch=forward_batch, is_verify=True)
    finally:
        mr.attn_backend, mr.decode_cuda_graph_runner = saved
    # the scheduler's write-after-read barrier waits on the draft runner's event (spec v2)
    event = mr.war_fastpath_read_done_event
    if event is not None:
        gate.draft_runner.war_fastpath_read_done_event = event
        mr.war_fastpath_read_done_event = None
    if on_publish is not None:
        on_publish(view.seq_lens)
    logits_output = out.logits_output
    if logits_output.hidden_states is None:
        raise RuntimeError("specgate true-off: the target returned no aux hidden states in DECODE mode")
    gate.buffers.append(slots_cpu, tokens, logits_output.hidden_states)
    if not batch.return_hidden_states:  # else one row per request, as a speculative step returns them
        logits_output.hidden_states = None
    raw = None
    if batch.return_logprob and not batch.sampling_info.is_all_greedy:
        raw = logits_output.next_token_logits.clone()
    next_ids = mr.sample(logits_output, forward_batch)
    if batch.return_logprob:  # SGLang's own spec-v2 logprobs: [bs, accepted] rows, here one token each
        if raw is not None:
            logits_output.next_token_logits = raw
        accept_index = torch.arange(bs, device=next_ids.device).view(bs, 1)
        compute_spec_v2_logprobs(batch, logits_output, next_ids, accept_index, 0)
    # draft fields pass through untouched: they are stale until the catch-up rewrites them
    next_draft_input = EagleDraftInput(
        bonus_tokens=next_ids.to(torch.int32), topk_p=draft_input.topk_p, topk_index=draft_input.topk_index,
        hidden_states=draft_input.hidden_states, num_tokens_per_req=1, num_tokens_for_logprob_per_req=1)  # fmt: skip
    result = GenerationBatchResult(
        logits_output=logits_output, next_token_ids=next_ids, can_run_cuda_graph=out.can_run_cuda_graph,
        speculative_num_draft_tokens=1, accept_lens=gate.ones[:bs], new_seq_lens=view.seq_lens,
        next_draft_input=next_draft_input, extra_keep_alive_refs=[forward_batch, tokens])  # fmt: skip
    result._specgate_off = True  # the scheduler's per-request metrics leave this step out
    return result


def extend_fields(batch, plan, sel, input_ids, out_cache_loc) -> dict:
    """The rows behind as one EXTEND batch over their buffered tokens: the fields every release reads."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    seq_lens = batch.seq_lens[sel]
    return dict(
        forward_mode=ForwardMode.EXTEND, reqs=[batch.reqs[i] for i in plan.sel], req_pool_indices=batch.req_pool_indices[sel],
        req_pool_indices_cpu=torch.from_numpy(plan.slots), seq_lens=seq_lens, orig_seq_lens=seq_lens.to(torch.int32),
        seq_lens_cpu=torch.from_numpy(plan.seq_lens), seq_lens_sum=int(plan.seq_lens.sum()), input_ids=input_ids,
        out_cache_loc=out_cache_loc.to(torch.int64), extend_lens=plan.counts.tolist(), prefix_lens=plan.starts.tolist(),
        extend_num_tokens=plan.total, extend_logprob_start_lens=plan.counts.tolist(),
        extend_input_logprob_token_ids=None, chunked_req_next_prompt_token=None, multimodal_inputs=None,
        input_embeds=None, replace_embeds=None, return_logprob=False, top_logprobs_nums=None, token_ids_logprobs=None,
        return_hidden_states=False, spec_info=None,
        sampling_info=None,  # the draft extend only takes a softmax (no rejection sampling)
    )  # fmt: skip


def extend_view(batch, plan, sel, input_ids, out_cache_loc):
    sub = copy.copy(batch)
    for name, value in extend_fields(batch, plan, sel, input_ids, out_cache_loc).items():
        setattr(sub, name, value)
    sub.seq_lens_cpu_cache = None
    sub.capture_hidden_mode = None
    return sub


def draft_extend(gate, batch, plan, sel, input_ids, aux, out_cache_loc):
    """SGLang's prefill draft extend over the rows behind; returns their fresh draft state."""
    return run_draft_extend(gate, batch, sel, aux, extend_view(batch, plan, sel, input_ids, out_cache_loc))


def run_draft_extend(gate, batch, sel, aux, sub):
    from sglang.srt.speculative import eagle_worker_v2 as ew2

    draft_worker = gate.worker.draft_worker
    with (
        draft_worker.draft_tp_context(draft_worker.draft_runner.tp_group),
        ew2.speculative_moe_backend_context(),
        ew2.speculative_moe_a2a_backend_context(),
    ):
        return draft_worker._draft_extend_for_prefill(sub, aux, batch.spec_info.bonus_tokens[sel])


def release_hooks(active) -> dict:
    """The prefix cache keeps a finishing request only up to its first token without draft KV."""

    def cache_commit_len(original, self):
        committed = original(self)
        gate = active()
        if gate is None:
            return committed
        # asked twice per release (committed, then over-allocated): counted once
        return gate.commit_len(self.req_pool_idx, committed, self.cache_protected_len, count=not self.kv_overallocated_freed)

    return {f"{REQ}._cache_commit_len": cache_commit_len}
