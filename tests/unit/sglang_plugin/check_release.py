"""Run in a subprocess against SGLang 0.5.15 on PYTHONPATH: a request that finishes while the true-off
gate holds buffered tokens, through SGLang's real release path (Req, ReqToTokenPool, RadixCache,
TokenToKVPoolAllocator on CPU) with the plugin's hooks applied."""

import json

import cpu_stubs  # noqa: F401  (first: lets SGLang import on CPU)
import numpy as np  # noqa: E402
import torch  # noqa: E402
from sglang.srt.managers.schedule_batch import Req  # noqa: E402
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

from specgate.sglang import trueoff  # noqa: E402

load_plugins()
HookRegistry.apply_hooks()
set_global_server_args_for_scheduler(ServerArgs(model_path="none", speculative_algorithm="EAGLE3", page_size=1))

KV = 256
pool = ReqToTokenPool(size=4, max_context_len=64, device="cpu", enable_memory_saver=False)
alloc = TokenToKVPoolAllocator(KV, torch.float16, "cpu", kvcache=None, need_sort=False)
tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=pool, token_to_kv_pool_allocator=alloc,
                                  page_size=1, is_eagle=True))  # fmt: skip
gate = trueoff.TrueOffGate.__new__(trueoff.TrueOffGate)
gate.init_state({"disable_at": 2, "buffer_tokens": 8}, pool=pool.req_to_token.shape[0], aux_dim=2,
                dtype=torch.float32, device="cpu")  # fmt: skip
gate.req_to_token_pool = pool
trueoff._ACTIVE = gate


def run(prompt, output, buffered, insert=True):
    """A request with `prompt` + `output` tokens in KV (one more allocated, as spec v2 does), the last
    `buffered` of them decoded while the gate was off; it finishes and SGLang releases it."""
    req = Req("r", "", list(prompt), SamplingParams(max_new_tokens=len(output)))
    prefix = tree.match_prefix(MatchPrefixParams(key=RadixKey(list(prompt), None, is_bigram=True)))
    hit = len(prefix.device_indices)
    pool.alloc([req])
    fill = len(prompt) + len(output)
    req.prefix_indices, req.cache_protected_len, req.last_node = prefix.device_indices, hit, prefix.last_device_node
    tree.inc_lock_ref(req.last_node)
    new = alloc.alloc(fill + 1 - hit)
    pool.write((req.req_pool_idx, slice(0, fill + 1)), torch.cat([prefix.device_indices.to(torch.int64), new]).to(torch.int32))
    req.output_ids = list(output)
    req.kv_committed_len, req.kv_allocated_len = fill, fill + 1
    slot = req.req_pool_idx
    for _ in range(buffered):
        gate.buffers.append(np.full(1, slot), torch.zeros(1), torch.zeros(1, 2))
    gate.len_ok[slot] = True
    release_kv_cache(req, tree, is_insert=insert)
    return {"hit": hit, "slot_free": slot in pool.free_slots, "n_after": int(gate.buffers.n_cpu[slot]),
            "len_ok_after": bool(gate.len_ok[slot]), "cached": tree.total_size(), "free_kv": alloc.available_size()}


prompt, output = list(range(100, 110)), list(range(200, 206))
steps = {"start_free": alloc.available_size()}
steps["finish_while_off"] = run(prompt, output, buffered=3)
# the next turn of the same chat: its prompt is the whole first exchange, and more
steps["next_turn"] = run(prompt + output + [300, 301], [400, 401], buffered=8)  # all 8 past the cached prefix
steps["abort_while_off"] = run([7, 8, 9, 10, 11], [12, 13], buffered=2, insert=False)
steps["counters"] = {k: gate.counters()[k] for k in ("released", "trimmed_requests", "trimmed_tokens")}
tree.evict(EvictParams(num_tokens=KV))
steps["end_free"] = alloc.available_size()

# per-request metrics: an off step (stride 1) is not a verify step; a speculative one is
from types import SimpleNamespace  # noqa: E402

from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor  # noqa: E402
from sglang.srt.managers.tokenizer_manager import TokenizerManager  # noqa: E402
from sglang.srt.managers.utils import GenerationBatchResult  # noqa: E402

processor = SchedulerBatchResultProcessor.__new__(SchedulerBatchResultProcessor)
object.__setattr__(processor, "model_worker", SimpleNamespace(on_verify_complete_cpu=lambda *a, **k: None))  # a frozen dataclass
reqs = [Req(f"m{i}", "", [1, 2, 3], SamplingParams(max_new_tokens=50)) for i in range(2)]
for stride, ids, accept in ((1, [5, 6], [1, 1]), (4, [7, 8, 9, 0, 10, 0, 0, 0], [3, 1]), (1, [11, 12], [1, 1])):
    result = GenerationBatchResult(next_token_ids=torch.tensor(ids), accept_lens=torch.tensor(accept),
                                   speculative_num_draft_tokens=stride)  # fmt: skip
    if stride == 1:
        result._specgate_off = True  # as the off step marks its result
    processor._resolve_spec_v2_tokens(result, SimpleNamespace(reqs=reqs))
steps["per_request"] = [
    {"verify_ct": r.spec_verify_ct, "histogram": r.spec_correct_drafts_histogram, "committed": r.kv_committed_len}
    for r in reqs
]
tm = TokenizerManager.__new__(TokenizerManager)
tm.server_args = SimpleNamespace(speculative_num_draft_tokens=4)
recv = SimpleNamespace(spec_verify_ct=[2], spec_num_correct_drafts=[3], completion_tokens=[9],
                       spec_correct_drafts_histogram=[[0, 1, 1]])  # fmt: skip
meta = {}
tm._calculate_spec_decoding_metrics(meta, recv, 0)
steps["meta_info"] = meta
print("RESULT", json.dumps(steps))
