"""Run in a subprocess against one SGLang release on PYTHONPATH (0.5.15, 0.5.17 or 0.5.23): a request that
finishes while the true-off gate holds buffered tokens, through SGLang's real release path (Req,
ReqToTokenPool, RadixCache, TokenToKVPoolAllocator on CPU) with the plugin's hooks applied (mode true-off:
the hooks of the adapter `trueoff.select_adapter()` picks for this release) or not (mode sglang-steps0, for
contrast); then SGLang's per-request spec metrics through its real result processor and tokenizer manager.

What differs between releases in how a request is set up and released is kept in the small helpers below,
chosen by feature detection on the installed SGLang (never on the adapter under test):
  0.5.15  the request's KV bookkeeping is flat on Req; release_kv_cache(req, tree, is_insert=)
  0.5.17  req_pool_idx / cache_protected_len / kv_committed_len stay on Req, kv_allocated_len moves to
          req.kv (a ReqKvInfo made when the slot's KV is allocated, None again once released)
  0.5.23  all of it lives in req.kv (a ReqKvInfo every Req carries); the match result carries a length
          (device_prefix_len) and the tree hands out the path's indices; a TreeLock pins the prefix;
          release_kv_cache(req, tree, *, checkpoint=) checkpoints the tree instead of inserting
The adapter under test is only ever reached through SGLang's own calls (its hooks) and its slot_of.
"""

import dataclasses
import inspect
import json
import pkgutil
from array import array

import cpu_stubs  # noqa: F401  (first: lets SGLang import on CPU)
import numpy as np  # noqa: E402
import sglang  # noqa: E402
import torch  # noqa: E402
from sglang.srt.managers import schedule_batch  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req  # noqa: E402
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.common import release_kv_cache  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler  # noqa: E402

from specgate.sglang import plugin, trueoff  # noqa: E402

load_plugins()
HookRegistry.apply_hooks()
# speculative_num_draft_tokens: 0.5.23's tokenizer manager reads it from the published server args
set_global_server_args_for_scheduler(ServerArgs(model_path="none", speculative_algorithm="EAGLE3", page_size=1,
                                                speculative_num_draft_tokens=4))  # fmt: skip

ADAPTER, WHY = trueoff.select_adapter()  # the adapter written for this release drives the gate, hooked or not
assert ADAPTER is not None, WHY
SETTINGS = plugin.gate_settings()
HOOKED = SETTINGS["mode"] == "true-off"

# -- this release's request layout (feature detection) ---------------------------------------------------
_KV_INFO = getattr(schedule_batch, "ReqKvInfo", None)
_KV_FIELDS = {f.name for f in dataclasses.fields(_KV_INFO)} if _KV_INFO is not None else set()
LAYOUT = "record" if "req_pool_idx" in _KV_FIELDS else "split" if _KV_FIELDS else "flat"
RELEASE_FLAG = "checkpoint" if "checkpoint" in inspect.signature(release_kv_cache).parameters else "is_insert"


def kv(req):
    """Where the request's req_pool_idx, cache_protected_len and kv_committed_len live."""
    return req.kv if LAYOUT == "record" else req


VOCAB = 1024


def new_req(rid, prompt, max_new_tokens, stop=None):
    """A request as the scheduler makes it: its ids in an array("q"), its sampling params normalized."""
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=stop)
    params.normalize(None)
    return Req(rid, "", array("q", prompt), params, vocab_size=VOCAB)


def set_allocated(req, n):
    """The KV allocated for the request's row, as SGLang's allocation records it."""
    if LAYOUT == "flat":
        req.kv_allocated_len = n
    elif LAYOUT == "split":  # alloc_for_extend makes the record when it allocates the row's KV
        req.kv = _KV_INFO(kv_allocated_len=n, swa_evicted_seqlen=0)
    else:
        req.kv.kv_allocated_len = n


def match(tree, tokens):
    """(hit length, the hit's KV indices, the last matched node)."""
    m = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens), None, is_bigram=True)))
    if hasattr(m, "device_indices"):  # 0.5.15, 0.5.17
        return len(m.device_indices), m.device_indices, m.last_device_node
    hit = m.device_prefix_len  # 0.5.23: a length; the indices are read off the matched path
    return hit, tree.path_device_indices(m.last_device_node)[:hit], m.last_device_node


def pin(tree, req, node):
    """Pin the matched prefix for the request, as the scheduler does when it admits it."""
    req.last_node = node
    if LAYOUT == "record":  # 0.5.23: a TreeLock the release (and each checkpoint) gives back
        req.lock = tree.lock(node)
    else:
        tree.inc_lock_ref(node)


def finish(req, insert, accepted):
    """The request finishes (insert: by its own finish check; else it is aborted)."""
    if not insert:
        req.to_finish = FINISH_ABORT()
    # the real finish check over the last step's `accepted` tokens: a length or stop-token finish, or the abort
    req.update_finish_state(accepted)
    assert req.finished()


def release(tree, req, insert):
    """SGLang releases the finished request: into the prefix cache (insert), or not (an abort)."""
    release_kv_cache(req, tree, **{RELEASE_FLAG: insert})


def owned_len(req):
    """What this release's own length method reports for the request (the plugin's hook unwrapped)."""
    for name in ("owned_kv_len", "effective_kv_committed_len", "_cache_commit_len"):
        method = getattr(type(req), name, None)
        if method is not None:
            return getattr(method, "__wrapped__", method)(req)
    raise AssertionError("no KV length method on Req")


def hooked_targets():
    """Every release-path target of this adapter, with whether the plugin's hook wraps it now."""
    keys = ("free_slot", "resolve_spec_tokens", "spec_decoding_metrics")
    targets = [ADAPTER.TARGETS[k] for k in keys] + list(ADAPTER.release_hooks(lambda: None))
    out = {}
    for target in targets:
        owner, attr = target.rsplit(".", 1)
        out[target] = hasattr(getattr(pkgutil.resolve_name(owner), attr), "__wrapped__")
    return out


# -- the release path --------------------------------------------------------------------------------------
KV = 256
pool = ReqToTokenPool(size=4, max_context_len=64, device="cpu", enable_memory_saver=False)
alloc = TokenToKVPoolAllocator(KV, torch.float16, "cpu", kvcache=None, need_sort=False)
tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=pool, token_to_kv_pool_allocator=alloc,
                                  page_size=1, is_eagle=True))  # fmt: skip
gate = trueoff.TrueOffGate.__new__(trueoff.TrueOffGate)
gate.adapter = ADAPTER  # init_state reads the slot through the adapter (req.kv.req_pool_idx in 0.5.23)
gate.init_state({"disable_at": 2, "buffer_tokens": 8}, pool=pool.req_to_token.shape[0], aux_dim=2,
                dtype=torch.float32, device="cpu")  # fmt: skip
gate.req_to_token_pool = pool
trueoff._ACTIVE = gate
# what the adapter's hooks ask of the gate during each release: [committed, protected, keep, counted] per
# commit_len call (the KV length hook), and the slots reset (the ReqToTokenPool.free hook)
asked, reset = [], []
_commit_len, _release = gate.commit_len, gate.release


def _record_commit_len(slot, committed, protected, count=True):
    keep = _commit_len(slot, committed, protected, count)
    asked.append([committed, protected, keep, count])
    return keep


def _record_release(slot):
    reset.append(slot)
    return _release(slot)


gate.commit_len, gate.release = _record_commit_len, _record_release


def run(prompt, output, buffered, insert=True, stop=None, accepted=1):
    """A request with `prompt` + `output` tokens in KV (one more allocated, as spec v2 does), the last
    `buffered` of them decoded while the gate was off; its last step accepted `accepted` tokens; it finishes
    (at max_new_tokens = len(output), or on a `stop` token) or is aborted, and SGLang releases it."""
    req = new_req("r", prompt, len(output) if stop is None else 4 * len(output), stop=stop)
    hit, indices, node = match(tree, prompt)
    pool.alloc([req])
    fill = len(prompt) + len(output)
    req.prefix_indices = indices
    kv(req).cache_protected_len = hit
    pin(tree, req, node)
    new = alloc.alloc(fill + 1 - hit)
    slot = kv(req).req_pool_idx
    pool.write((slot, slice(0, fill + 1)), torch.cat([indices.to(torch.int64), new]).to(torch.int32))
    req.output_ids.extend(output)
    kv(req).kv_committed_len = fill
    set_allocated(req, fill + 1)
    assert ADAPTER.slot_of(req) == slot  # the adapter reads the slot where this release keeps it
    # the gate's count for the slot before this request's tokens: with the hooks the last release reset it
    n_start = int(gate.buffers.n_cpu[slot])
    if not HOOKED:  # nothing resets this stand-in gate without the hooks: start from this request's own tokens
        gate.buffers.reset(np.array([slot]))
    for _ in range(buffered):
        gate.buffers.append(np.full(1, slot), torch.zeros(1), torch.zeros(1, 2))
    gate.len_ok[slot] = True
    finish(req, insert, accepted)
    free_before, cached_before, owned = alloc.available_size(), tree.total_size(), owned_len(req)
    asked.clear()
    reset.clear()
    release(tree, req, insert)
    return {"slot": slot, "n_start": n_start, "hit": hit, "owned": owned, "finished_len": req.finished_len,
            "cached_before": cached_before, "cached": tree.total_size(), "free_kv": alloc.available_size(),
            "freed": alloc.available_size() - free_before, "slot_free": slot in pool.free_slots,
            "slot_after": ADAPTER.slot_of(req), "n_after": int(gate.buffers.n_cpu[slot]),
            "len_ok_after": bool(gate.len_ok[slot]), "asked": list(asked), "reset": list(reset)}  # fmt: skip


prompt, output = list(range(100, 110)), list(range(200, 206))
steps = {"version": sglang.__version__, "adapter": ADAPTER.LINE, "layout": LAYOUT, "hooked": hooked_targets(),
         "start_free": alloc.available_size()}  # fmt: skip
steps["finish_while_off"] = run(prompt, output, buffered=3)
# the next turn of the same chat: its prompt is the whole first exchange, and more
steps["next_turn"] = run(prompt + output + [300, 301], [400, 401], buffered=8)  # all 8 past the cached prefix
steps["abort_while_off"] = run([7, 8, 9, 10, 11], [12, 13], buffered=2, insert=False)
# overlap: a speculative step accepted [603, 699, 604], 699 a stop token, and the scheduler had already launched
# the next step for the request, an off step (one buffered token, past the committed ones), when it saw the stop
steps["stop_then_off"] = run(list(range(500, 508)), [600, 601, 602, 603, 699, 604], buffered=1, stop=[699], accepted=3)
steps["counters"] = {k: gate.counters()[k] for k in ("released", "trimmed_requests", "trimmed_tokens")}
tree.evict(EvictParams(num_tokens=KV))
steps["end_free"] = alloc.available_size()
steps["end_cached"] = tree.total_size()

# -- per-request metrics: an off step (stride 1) is not a verify step; a speculative one is -----------------
from types import SimpleNamespace  # noqa: E402

from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor  # noqa: E402
from sglang.srt.managers.tokenizer_manager import TokenizerManager  # noqa: E402
from sglang.srt.managers.utils import GenerationBatchResult  # noqa: E402

processor = SchedulerBatchResultProcessor.__new__(SchedulerBatchResultProcessor)
_fields = {f.name for f in dataclasses.fields(SchedulerBatchResultProcessor)}
# a frozen dataclass (with slots in 0.5.23): set through object.__setattr__
object.__setattr__(processor, "model_worker", SimpleNamespace(on_verify_complete_cpu=lambda *a, **k: None))
if "metrics_reporter" in _fields:  # 0.5.23 snapshots every spec result for its metrics first
    object.__setattr__(processor, "metrics_reporter", SimpleNamespace(snapshot_spec_decode_metrics=lambda *a, **k: None))
reqs = [new_req(f"m{i}", [1, 2, 3], 50) for i in range(2)]
_result_fields = {f.name for f in dataclasses.fields(GenerationBatchResult)}
# 0.5.23 names the output row stride apart from the draft token count (the off step sets both to 1)
STRIDE = (lambda s: {"speculative_output_stride": s}) if "speculative_output_stride" in _result_fields else (lambda s: {})
for stride, ids, accept in ((1, [5, 6], [1, 1]), (4, [7, 8, 9, 0, 10, 0, 0, 0], [3, 1]), (1, [11, 12], [1, 1])):
    result = GenerationBatchResult(next_token_ids=torch.tensor(ids), accept_lens=torch.tensor(accept),
                                   speculative_num_draft_tokens=stride, **STRIDE(stride))  # fmt: skip
    if stride == 1:
        result._specgate_off = True  # as the off step marks its result
    processor._resolve_spec_v2_tokens(result, SimpleNamespace(reqs=reqs, has_grammar=False))
steps["per_request"] = [
    {"verify_ct": r.spec_verify_ct, "histogram": list(r.spec_correct_drafts_histogram), "committed": kv(r).kv_committed_len}
    for r in reqs
]
tm = TokenizerManager.__new__(TokenizerManager)
tm.server_args = SimpleNamespace(speculative_num_draft_tokens=4)  # 0.5.15 and 0.5.17 read it here
recv = SimpleNamespace(spec_verify_ct=[2], spec_num_correct_drafts=[3], completion_tokens=[9],
                       spec_correct_drafts_histogram=[[0, 1, 1]])  # fmt: skip
meta = {}
tm._calculate_spec_decoding_metrics(meta, recv, 0)
steps["meta_info"] = meta
print("RESULT", json.dumps(steps))
