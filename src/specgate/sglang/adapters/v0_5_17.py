"""The true-off gate's adapter for SGLang 0.5.17: what touches SGLang's objects.

The same hooks as 0.5.15 (`specgate.sglang.adapters.v0_5_15`), with what this line changed:
  - forward_batch_generation takes `grammar_barrier`: EAGLE stays overlapped with grammars, and the
    scheduler advances the previous step's grammar state through it. An off step with a grammar calls
    it before the target's sampler builds the vocabulary mask, as verify does.
  - the capture mode of hidden states is an argument of ForwardBatch.init_new, not a batch field.
  - Req._cache_commit_len is Req.effective_kv_committed_len, asked once per release.
  - the off step samples after the forward (is_verify=True), as verify does, so a logprob request's
    logits are kept before the sampler scales them by the temperature in place.
  - the rank is worker.ps.tp_rank; mamba and mrope flags moved to the model config.
"""

from __future__ import annotations

import copy
import os
import sys

import torch

from specgate.sglang.adapters import v0_5_15

LINE = "SGLang 0.5.17"
RELEASES = ("0.5.17",)  # checked against these sources (0.5.16 differs: no grammar barrier yet)
TARGETS = v0_5_15.TARGETS  # the hooked methods kept their paths
FORWARD_PARAMS = ("on_publish", "grammar_barrier")
REQ = v0_5_15.REQ
CANARY_ENV = "SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE"  # writes into the batch's sampling_info, which a catch-up has not

# file (under sglang/srt) -> class (None: module level) -> member -> its parameter names, exactly (None: must exist)
CONTRACT = {
    "speculative/eagle_worker_v2.py": {
        "EAGLEWorkerV2": {
            "forward_batch_generation": ["self", "batch", "on_publish", "grammar_barrier"],
            "init_cuda_graphs": ["self"],
            "war_fastpath_runner": None,
            "adaptive_controller": None,
            "speculative_algorithm": None,
            "server_args": None,
            "ps": None,
        },
        "EagleDraftWorker": {
            "_draft_extend_for_prefill": ["self", "batch", "target_hidden_states", "next_token_ids", "mm_input_embeds"],
            "draft_tp_context": None,
            "draft_runner": None,
        },
        None: {"speculative_moe_backend_context": None, "speculative_moe_a2a_backend_context": None},
    },
    "speculative/base_spec_worker.py": {
        "BaseSpecWorker": {"target_worker": None, "draft_worker": None, "war_fastpath_runner": None}
    },
    "distributed/parallel_state_wrapper.py": {"ParallelState": {"tp_rank": None}},
    "model_executor/forward_batch_info.py": {
        "ForwardBatch": {"init_new": ["cls", "batch", "model_runner", "capture_hidden_mode", "return_hidden_states_before_norm"]}
    },
    "layers/logprob_processor.py": {
        None: {"compute_spec_v2_logprobs": ["batch", "logits_output", "predict", "accept_index", "speculative_num_steps"]}
    },
    "managers/schedule_batch.py": {"Req": {"effective_kv_committed_len": ["self"]}},
    "mem_cache/common.py": {None: {"release_kv_cache": ["req", "tree_cache", "is_insert"]}},
    "mem_cache/memory_pool.py": {"ReqToTokenPool": {"free": ["self", "req"], "req_to_token": None}},
    "managers/tokenizer_manager.py": {
        "TokenizerManager": {"_calculate_spec_decoding_metrics": ["self", "meta_info", "recv_obj", "i"]}
    },
    "managers/scheduler.py": {"Scheduler": {"get_internal_state": ["self", "recv_req"], "_advance_pending_grammar": ["self"]}},
    "model_executor/runner/decode_cuda_graph_runner.py": {
        "DecodeCudaGraphRunner": {
            "__init__": ["self", "model_runner", "attn_backend", "speculative_num_steps", "speculative_num_draft_tokens"],
            "capture": ["self"],
            "capture_prepare": ["self", "size", "stream_idx", "num_tokens"],
            "get_spec_info": ["self", "num_tokens"],
            "_validate_capture_hidden_mode": ["self", "forward_batch"],
            "execute": ["self", "forward_batch", "pp_proxy_tensors"],
            "capture_forward_mode": None,
            "capture_hidden_mode": None,
            "captured_req_width": None,
            "capture_bs": None,
        }
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
            "is_hybrid_swa": None,
            "sliding_window_size": None,
            "use_mla_backend": None,
            "enable_hisparse": None,
            "model_config": None,
            "device": None,
            "tp_group": None,
        }
    },
    "configs/model_config.py": {"ModelConfig": {"model_is_mrope": None, "is_multimodal": None}},
    "configs/hybrid_arch.py": {None: {"mambaish_config": ["model_config"]}},
    "managers/tp_worker.py": {
        "TpModelWorker": {
            "forward_batch_generation": [
                "self",
                "batch",
                "forward_batch",
                "pp_proxy_tensors",
                "is_verify",
                "skip_attn_backend_init",
                "capture_hidden_mode",
            ],
            "model_runner": None,
        }
    },
    "speculative/eagle_utils.py": {
        None: {
            "get_draft_input_from_target_hidden_dim": ["model_runner"],
            "_eagle_prefill_tail_tokens": ["batch", "next_token_ids"],
        }
    },
    "managers/scheduler_components/batch_result_processor.py": {
        "SchedulerBatchResultProcessor": {
            "_resolve_spec_v2_tokens": ["self", "result", "batch"],
            "advance_grammar_fsm": ["self", "result", "batch"],
            "model_worker": None,
        }
    },
    "managers/overlap_utils.py": {
        None: {"_DEBUG_ASSERT": None},
        "FutureMap": {
            "resolve_seq_lens_cpu": ["self", "batch"],
            "publish": ["self", "future_indices", "new_seq_lens", "confidence"],
            "needs_cpu_seq_lens": None,
            "publish_ready": None,
            "new_seq_lens_buf": None,
            "_publish_fresh": None,
        },
    },
}
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
            "num_correct_drafts",
            "routed_experts_output",
            "indexer_topk_output",
            "expert_distribution_metrics",
        ]
    },
    "speculative/eagle_info.py": {
        "EagleDraftInput": [
            "topk_p",
            "topk_index",
            "hidden_states",
            "bonus_tokens",
            "num_tokens_per_req",
            "num_tokens_for_logprob_per_req",
            "future_indices",
            "dsa_topk_indices",
        ]
    },
    "managers/schedule_batch.py": {
        "ScheduleBatch": [
            "reqs",
            "forward_mode",
            "is_extend_in_batch",
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
            "extend_input_logprob_token_ids",
            "chunked_req_next_prompt_token",
            "multimodal_inputs",
            "input_embeds",
            "replace_embeds",
            "replace_positions",
            "return_logprob",
            "has_grammar",
            "return_hidden_states",
            "spec_info",
            "sampling_info",
            "top_logprobs_nums",
            "token_ids_logprobs",
        ],
        "Req": [
            "req_pool_idx",
            "kv_committed_len",
            "cache_protected_len",
            "kv",
            "spec_verify_ct",
            "spec_correct_drafts_histogram",
        ],
    },
}


def server_args(worker):
    return worker.server_args  # the start-up record; the flags unsupported() reads do not change at run time


def tp_rank(worker) -> int:
    return worker.ps.tp_rank


def slot_of(req):
    return req.req_pool_idx


def target_checks(worker) -> list:
    """(bad, why) for targets the off path does not handle, read where this release keeps them."""
    from sglang.srt.configs.hybrid_arch import mambaish_config

    mr = worker.target_worker.model_runner
    mc, sa = mr.model_config, worker.server_args
    return [
        (mambaish_config(mc) is not None, "a hybrid linear-attention target (mamba/GDN)"),
        (mr.is_hybrid_swa or mr.sliding_window_size is not None, "a sliding-window attention target"),
        (mc.model_is_mrope, "an mrope target"),
        (mc.is_multimodal, "a multimodal target"),
        (mr.use_mla_backend, "an MLA target (DeepSeek-style attention, DSA included)"),
        (mr.enable_hisparse, "hierarchical sparse attention"),
        (getattr(sa, "enable_unified_memory", False), "the unified memory pool"),
        (
            getattr(sa, "enable_lmcache", False) or getattr(sa, "enable_flexkv", False),
            "an LMCache or FlexKV prefix cache (it reads kv_committed_len itself)",
        ),
        (os.environ.get(CANARY_ENV, "").lower() in ("1", "true"), f"{CANARY_ENV}"),
    ]


def plain_decode_runner(model_runner, attn_backend):
    # the captured hidden mode is fixed in this line (a batch asking for more raises), and FULL is the most
    return v0_5_15.plain_decode_runner(model_runner, attn_backend, recapture=False)


def arm(gate, worker) -> int:
    return v0_5_15.arm(gate, worker, plain_decode_runner)


def decode_view(gate, batch):
    return v0_5_15.decode_fields(gate, batch)  # the capture mode goes to ForwardBatch.init_new


def hand_over_war_event(gate, mr) -> None:
    """The scheduler's write-after-read barrier waits on the draft runner's event (spec v2)."""
    event = mr.war_fastpath_read_done_event
    if event is not None:
        gate.draft_runner.war_fastpath_read_done_event = event
        mr.war_fastpath_read_done_event = None


def spec_logprobs(batch, logits_output, next_ids) -> None:
    """SGLang's own spec-v2 logprobs: [bs, accepted] rows, here one token each."""
    from sglang.srt.layers.logprob_processor import compute_spec_v2_logprobs

    bs = len(batch.reqs)
    compute_spec_v2_logprobs(batch, logits_output, next_ids, torch.arange(bs, device=next_ids.device).view(bs, 1), 0)


def result_fields(out, draft_input) -> tuple[dict, dict]:
    """This line's extra fields of the off step's (EagleDraftInput, GenerationBatchResult)."""
    return {"dsa_topk_indices": draft_input.dsa_topk_indices}, {
        "routed_experts_output": out.routed_experts_output,
        "indexer_topk_output": out.indexer_topk_output,
        "expert_distribution_metrics": out.expert_distribution_metrics,
    }


def plain_step(gate, batch, slots_cpu, on_publish, grammar_barrier=None, line=None):
    """One decode step of the target alone, in the result format of a spec-v2 step. `line`: the adapter
    module whose release-specific parts run (0.5.23 reuses this step with its own)."""
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
    from sglang.srt.speculative.eagle_info import EagleDraftInput

    line = line or sys.modules[__name__]
    mr, bs, draft_input = gate.target_mr, len(batch.reqs), batch.spec_info
    view, tokens = decode_view(gate, batch)
    line.before_forward(mr)
    saved = mr.attn_backend, mr.decode_cuda_graph_runner
    mr.attn_backend, mr.decode_cuda_graph_runner = gate.attn_backend, gate.graph_runner
    try:
        forward_batch = ForwardBatch.init_new(view, mr, capture_hidden_mode=CaptureHiddenMode.FULL,
                                              return_hidden_states_before_norm=False)  # fmt: skip
        # the forward alone: sampling follows the grammar barrier, as in verify
        out = gate.worker.target_worker.forward_batch_generation(batch=None, forward_batch=forward_batch, is_verify=True)
    finally:
        mr.attn_backend, mr.decode_cuda_graph_runner = saved
    line.hand_over_war_event(gate, mr)
    logits_output = out.logits_output
    if logits_output.hidden_states is None:
        raise RuntimeError("specgate true-off: the target returned no aux hidden states in DECODE mode")
    gate.buffers.append(slots_cpu, tokens, logits_output.hidden_states)
    if batch.has_grammar and grammar_barrier is not None:
        grammar_barrier()  # the previous step's tokens reach the grammar before its mask is built
    raw = None
    if batch.return_logprob and not batch.sampling_info.is_all_greedy:
        raw = logits_output.next_token_logits.clone()  # the sampler scales the logits by the temperature in place
    next_ids = mr.sample(logits_output, forward_batch)
    if on_publish is not None:
        on_publish(view.seq_lens)
    # else one row per request, as a speculative step returns them (a copy: graph outputs are reused buffers)
    logits_output.hidden_states = logits_output.hidden_states.clone() if batch.return_hidden_states else None
    if batch.return_logprob:
        if raw is not None:
            logits_output.next_token_logits = raw
        line.spec_logprobs(batch, logits_output, next_ids)
    draft_extra, result_extra = line.result_fields(out, draft_input)
    # draft fields pass through untouched: they are stale until the catch-up rewrites them
    next_draft_input = EagleDraftInput(
        bonus_tokens=next_ids.to(torch.int32), topk_p=draft_input.topk_p, topk_index=draft_input.topk_index,
        hidden_states=draft_input.hidden_states, num_tokens_per_req=1, num_tokens_for_logprob_per_req=1,
        **draft_extra)  # fmt: skip
    result = GenerationBatchResult(
        logits_output=logits_output, next_token_ids=next_ids, can_run_cuda_graph=out.can_run_cuda_graph,
        speculative_num_draft_tokens=1, accept_lens=gate.ones[:bs], new_seq_lens=view.seq_lens,
        next_draft_input=next_draft_input, extra_keep_alive_refs=[forward_batch, tokens], **result_extra)  # fmt: skip
    result._specgate_off = True  # the scheduler's per-request metrics leave this step out
    return result


def before_forward(mr) -> None:
    """Nothing in this line: the target runner's WAR mailbox holds only what its own decode graph wrote."""


def extend_view(batch, plan, sel, input_ids, out_cache_loc):
    sub = copy.copy(batch)
    for name, value in v0_5_15.extend_fields(batch, plan, sel, input_ids, out_cache_loc).items():
        setattr(sub, name, value)
    sub.replace_positions = None
    return sub


def draft_extend(gate, batch, plan, sel, input_ids, aux, out_cache_loc):
    """SGLang's prefill draft extend over the rows behind; returns their fresh draft state."""
    return v0_5_15.run_draft_extend(gate, batch, sel, aux, extend_view(batch, plan, sel, input_ids, out_cache_loc))


def release_hooks(active) -> dict:
    """The prefix cache keeps a finishing request only up to its first token without draft KV."""

    def effective_kv_committed_len(original, self):
        committed = original(self)
        gate = active()
        if gate is None or self.req_pool_idx is None:
            return committed
        # asked once per release, before the cache insert and before the slot is freed
        return gate.commit_len(self.req_pool_idx, committed, self.cache_protected_len)

    return {f"{REQ}.effective_kv_committed_len": effective_kv_committed_len}
