"""The true-off gate's adapter for SGLang 0.5.23: what touches SGLang's objects.

The same hooks as 0.5.15 (`specgate.sglang.adapters.v0_5_15`), with what this line changed:
  - forward_batch_generation takes `grammar_barrier` and `pp_proxy_tensors` (prefill moved to
    `_forward_prefill_batch`); an off step with a grammar calls the barrier before sampling.
  - the write-after-read mailbox is `shared_read_done_event`, read from the worker's
    `last_shared_read_runner` (the draft runner). The target runner's mailbox is not cleared in
    speculative mode, so the off step clears it before its forward and always hands what the plain
    replay left (None: the scheduler's whole-forward fence) to the runner the scheduler reads.
  - the request's KV fields live in `req.kv` (ReqKvInfo); `Req.owned_kv_len` is asked once per release.
  - the draft extend takes `kv_loc_plan` (None: the runner plans from the virtual slot ids, as for any
    forward of its own), and the tensor-parallel context comes from the draft's parallel layout.
  - the graph runner's `capture()` wraps `_capture()`; the plain runner sets its modes there.
  - the spec logprob helper is `compute_spec_logprobs(..., chain_stride=)`.
  - graph outputs are views of buffers every runner shares: rows kept past the step are copied.
"""

from __future__ import annotations

import sys

from specgate.sglang.adapters import v0_5_15, v0_5_17

LINE = "SGLang 0.5.23"
RELEASES = ("0.5.23",)  # checked against these sources
TARGETS = v0_5_15.TARGETS  # the hooked methods kept their paths
FORWARD_PARAMS = ("on_publish", "grammar_barrier", "pp_proxy_tensors")
REQ = v0_5_15.REQ

# file (under sglang/srt) -> class (None: module level) -> member -> its parameter names, exactly (None: must exist)
CONTRACT = {
    "speculative/eagle_worker_v2.py": {
        "EAGLEWorkerV2": {
            "forward_batch_generation": ["self", "batch", "on_publish", "grammar_barrier", "pp_proxy_tensors"],
            "_forward_prefill_batch": ["self", "batch", "on_publish", "pp_proxy_tensors", "coordination_plan"],
            "init_cuda_graphs": ["self"],
            "last_shared_read_runner": None,
            "adaptive_controller": None,
            "speculative_algorithm": None,
            "server_args": None,
            "_draft_worker": None,
            "_target_worker": None,
        },
        "EagleDraftWorker": {
            "_draft_extend_for_prefill": [
                "self",
                "batch",
                "target_hidden_states",
                "next_token_ids",
                "mm_input_embeds",
                "kv_loc_plan",
            ],
            "draft_runner": None,
            "parallel_layout": None,
        },
        None: {
            "speculative_moe_backend_context": None,
            "speculative_moe_a2a_backend_context": None,
            "draft_tp_context": None,
            "spec_stage_span": None,
        },
    },
    "speculative/base_spec_worker.py": {
        "BaseSpecWorker": {"target_worker": None, "draft_worker": None, "last_shared_read_runner": None}
    },
    "speculative/spec_utils.py": {None: {"draft_tp_context": ["layout"]}},
    "model_executor/forward_batch_info.py": {
        "ForwardBatch": {
            "init_new": [
                "cls",
                "batch",
                "model_runner",
                "capture_hidden_mode",
                "return_hidden_states_before_norm",
                "extend_position_info",
                "spec_mrope_positions",
                "kv_loc_plan",
                "write_cols",
            ]
        }
    },
    "layers/logprob_processor.py": {
        None: {"compute_spec_logprobs": ["batch", "logits_output", "predict", "accept_index", "chain_stride"]}
    },
    "managers/schedule_batch.py": {
        "Req": {"owned_kv_len": ["self"], "kv": None, "spec_verify_ct": None, "spec_correct_drafts_histogram": None},
        "ReqKvInfo": {"req_pool_idx": None, "cache_protected_len": None, "kv_committed_len": None, "kv_allocated_len": None},
    },
    "mem_cache/common.py": {None: {"release_kv_cache": ["req", "tree_cache", "checkpoint"]}},
    "mem_cache/memory_pool.py": {
        "ReqToTokenPool": {"free": ["self", "req"], "free_rows": ["self", "indices"], "req_to_token": None}
    },
    "managers/tokenizer_manager.py": {
        "TokenizerManager": {"_calculate_spec_decoding_metrics": ["self", "meta_info", "recv_obj", "i"]}
    },
    "managers/scheduler.py": {"Scheduler": {"get_internal_state": ["self", "recv_req"], "_apply_war_barrier": ["self"]}},
    "model_executor/runner/decode_cuda_graph_runner.py": {
        "DecodeCudaGraphRunner": {
            "__init__": [
                "self",
                "model_runner",
                "attn_backend",
                "speculative_num_steps",
                "speculative_num_draft_tokens",
                "record_nolora_graph",
            ],
            "capture": ["self"],
            "_capture": ["self"],
            "get_spec_info": ["self", "num_tokens"],
            "execute": ["self", "forward_batch", "pp_proxy_tensors"],
            "_validate_capture_hidden_mode": ["self", "forward_batch"],
            "_publish_read_done": ["self", "in_graph"],
            "capture_forward_mode": None,
            "capture_hidden_mode": None,
            "capture_bs": None,
            "ragged_verify_mode": None,
        }
    },
    "model_executor/model_runner.py": {
        "ModelRunner": {
            "_get_attention_backend": ["self", "init_new_workspace"],
            "init_decode_cuda_graph": ["self"],
            "sample": ["self", "logits_output", "forward_batch"],
            "shared_read_done_event": None,
            "decode_cuda_graph_runner": None,
            "attn_backend": None,
            "init_new_workspace": None,
            "req_to_token_pool": None,
            "is_hybrid_swa": None,
            "sliding_window_size": None,
            "use_mla_backend": None,
            "kv_index_translator": None,
            "model_config": None,
            "device": None,
        }
    },
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
                "return_kv_loc_plan",
            ]
        }
    },
    "speculative/eagle_utils.py": {
        None: {
            "get_draft_input_from_target_hidden_dim": ["model_runner"],
            "_eagle_prefill_tail_tokens": ["batch", "next_token_ids"],
        }
    },
    "managers/scheduler_components/batch_result_processor.py": {
        "SchedulerBatchResultProcessor": {"_resolve_spec_v2_tokens": ["self", "result", "batch"], "model_worker": None}
    },
    "managers/overlap_utils.py": {
        "FutureMap": {
            "resolve_seq_lens_cpu": ["self", "batch", "stream_ordered"],
            "publish": ["self", "future_indices", "new_seq_lens", "confidence"],
            "needs_cpu_seq_lens": None,
            "publish_ready": None,
            "new_seq_lens_buf": None,
            "_publish_fresh": None,
        }
    },
    "configs/hybrid_arch.py": {None: {"mambaish_config": ["model_config"]}},
}
FIELDS = {
    "managers/utils.py": {
        "GenerationBatchResult": [
            "logits_output",
            "next_token_ids",
            "can_run_cuda_graph",
            "speculative_num_draft_tokens",
            "speculative_output_stride",
            "num_non_draft_tokens_per_req",
            "accept_lens",
            "new_seq_lens",
            "next_draft_input",
            "extra_keep_alive_refs",
            "num_correct_drafts",
            "kv_loc_plan",
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
            "draft_probs",
            "cuda_graph_compatible",
        ]
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
            "sampling_info",
            "top_logprobs_nums",
            "token_ids_logprobs",
            "is_extend_in_batch",
            "forward_mode",
            "extend_input_logprob_token_ids",
            "multimodal_inputs",
            "input_embeds",
            "replace_embeds",
            "return_hidden_states_mode",
        ]
    },
}
CONTRACT["runtime_context.py"] = {None: {"get_parallel": []}}


def server_args(worker):
    return worker.server_args  # the start-up record, flat as before; the flags read here do not change at run time


def tp_rank(worker) -> int:
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().tp_rank


def slot_of(req):
    return req.kv.req_pool_idx


def target_checks(worker) -> list:
    """(bad, why) for targets and features the off path does not handle, read where this release keeps them."""
    from sglang.srt.configs.hybrid_arch import mambaish_config

    mr = worker.target_worker.model_runner
    mc, sa = mr.model_config, worker.server_args
    return [
        (mambaish_config(mc) is not None, "a hybrid linear-attention target (mamba/GDN)"),
        (mr.is_hybrid_swa or mr.sliding_window_size is not None, "a sliding-window attention target"),
        (mc.model_is_mrope, "an mrope target"),
        (getattr(mc, "is_multimodal", False), "a multimodal target"),
        (mr.use_mla_backend, "an MLA target (DeepSeek-style attention, DSA included)"),
        ((getattr(sa, "attn_dp_size", 1) or 1) > 1, "DP attention"),
        ((getattr(sa, "attn_cp_size", 1) or 1) > 1, "context parallelism"),
        (getattr(sa, "enable_hisparse", False), "hierarchical sparse attention"),
        (
            getattr(sa, "enable_unified_memory", False) or mr.kv_index_translator.is_translating,
            "the unified memory pool (virtual KV slots)",
        ),
        (getattr(sa, "enable_watermark", False), "watermarking (the plain sampler would mark off steps differently)"),
        (getattr(sa, "elastic_ep_backend", None) is not None, "elastic expert parallelism (recaptures its own graphs)"),
        (getattr(sa, "enable_pd_role_switch", False), "PD role switching"),
    ]


def plain_decode_runner(model_runner, attn_backend):
    # capture() wraps _capture(); __init__ derived the verify shape's state first, which for EAGLE-3 is all off
    return v0_5_15.plain_decode_runner(model_runner, attn_backend, capture_method="_capture", recapture=False)


def arm(gate, worker) -> int:
    return v0_5_15.arm(gate, worker, plain_decode_runner)


def plain_step(gate, batch, slots_cpu, on_publish, grammar_barrier=None, pp_proxy_tensors=None):
    """One decode step of the target alone (0.5.17's step with this line's parts below)."""
    assert pp_proxy_tensors is None, "specgate true-off: pipeline parallelism is refused at start-up"
    return v0_5_17.plain_step(gate, batch, slots_cpu, on_publish, grammar_barrier, line=sys.modules[__name__])


def before_forward(mr) -> None:
    mr.shared_read_done_event = None  # a verify replay's event, never cleared here, must not stand for this forward


def hand_over_war_event(gate, mr) -> None:
    """The scheduler reads the draft runner's mailbox: always hand over what the plain replay left (None: the
    scheduler's whole-forward fence)."""
    event, mr.shared_read_done_event = mr.shared_read_done_event, None
    gate.worker.last_shared_read_runner.shared_read_done_event = event


def spec_logprobs(batch, logits_output, next_ids) -> None:
    from sglang.srt.layers.logprob_processor import compute_spec_logprobs

    compute_spec_logprobs(batch, logits_output, next_ids, chain_stride=1)


def result_fields(out, draft_input) -> tuple[dict, dict]:
    draft_extra, result_extra = v0_5_17.result_fields(out, draft_input)
    return {**draft_extra, "draft_probs": draft_input.draft_probs}, {**result_extra, "speculative_output_stride": 1}


def draft_extend(gate, batch, plan, sel, input_ids, aux, out_cache_loc):
    """SGLang's prefill draft extend over the rows behind; returns their fresh draft state."""
    from sglang.srt.speculative import eagle_worker_v2 as ew2

    sub = v0_5_17.extend_view(batch, plan, sel, input_ids, out_cache_loc)
    draft_worker = gate.worker.draft_worker
    with (
        ew2.draft_tp_context(draft_worker.parallel_layout),
        ew2.speculative_moe_backend_context(),
        ew2.speculative_moe_a2a_backend_context(),
    ):
        return draft_worker._draft_extend_for_prefill(sub, aux, batch.spec_info.bonus_tokens[sel], None, kv_loc_plan=None)


def release_hooks(active) -> dict:
    """The prefix cache keeps a finishing request only up to its first token without draft KV."""

    def owned_kv_len(original, self):
        owned = original(self)
        gate = active()
        if gate is None or self.kv is None or self.kv.req_pool_idx is None:
            return owned
        # asked once per release, before the cache checkpoint and before the slot is freed
        return gate.commit_len(self.kv.req_pool_idx, owned, self.kv.cache_protected_len)

    return {f"{REQ}.owned_kv_len": owned_kv_len}
