"""SGLang's real release path and per-request spec metrics on CPU, against every SGLang in sglang_dirs().

check_release.py (run in a subprocess with one release on PYTHONPATH) builds that release's Req, ReqToTokenPool,
RadixCache and TokenToKVPoolAllocator, loads the plugin (true-off: the hooks of the adapter written for the
release; sglang-steps0: none of them, for contrast), and releases four requests through SGLang's own
release_kv_cache while the gate holds buffered tokens for them; then it drives SGLang's result processor and
tokenizer manager with off-step results.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import sglang_dirs

HERE = Path(__file__).parent
DIRS = sglang_dirs() or [pytest.param(None, marks=pytest.mark.skip("no SGLang"))]

# Where the releases differ on this path, read from their sources (everything else is expected alike):
#   asks       how often one release asks the request's KV length, which the adapter's release hook wraps.
#              0.5.15 asks Req._cache_commit_len twice (pop_committed_kv_cache, then pop_overallocated_kv_cache,
#              which has already set kv_overallocated_freed: the hook answers the same and counts it once);
#              0.5.17 asks Req.effective_kv_committed_len once, 0.5.23 Req.owned_kv_len once.
#   stop_trim  0.5.23's owned_kv_len ends at the stop, origin + output_ids[:finished_len], when a step accepted
#              tokens past it; 0.5.15's _cache_commit_len and 0.5.17's effective_kv_committed_len report
#              kv_committed_len whatever the finish, so those releases cache the token past the stop.
#   lifo       0.5.23's ReqToTokenPool hands out the row freed last (alloc_rows takes the end of free_slots), so
#              all four requests get row 4, each right after the last one released it; 0.5.15 and 0.5.17 take
#              the front of free_slots and hand out rows 1, 2, 3, 4.
# 0.5.23's checkpoint (instead of 0.5.15/0.5.17's insert) changes none of the numbers: it keys the same bigram
# key of what the length hook reports, sets cache_protected_len to the key's length, and release_kv_cache then
# frees [cache_protected_len, owned) itself, which is the last committed token plus the trimmed tail, as the
# insert path freed them. Its prompt-boundary split changes the tree's shape, not its size.
RELEASES = {
    "SGLang 0.5.15": {"asks": 2, "stop_trim": False, "lifo": False},
    "SGLang 0.5.17": {"asks": 1, "stop_trim": False, "lifo": False},
    "SGLang 0.5.23": {"asks": 1, "stop_trim": True, "lifo": True},
}
STEPS = ("finish_while_off", "next_turn", "abort_while_off", "stop_then_off")


def _release(sglang_dir):
    """(the installed version, the adapter written for it or None)."""
    from specgate.sglang import contract, trueoff

    srt = Path(sglang_dir) / "sglang" / "srt" if sglang_dir else trueoff.sglang_source_dir()
    version = contract.installed_version(srt)
    meant = [a for a in trueoff.adapters() if version in a.RELEASES]
    return version, meant[0] if meant else None


def run_release_check(sglang_dir, hooked: bool) -> dict:
    gate = {"disable_at": 2} if hooked else {"mode": "sglang-steps0", "disable_at": 2}
    env = dict(os.environ, SPECGATE_GATE=json.dumps(gate))
    if sglang_dir:
        env["PYTHONPATH"] = os.pathsep.join([sglang_dir, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(HERE / "check_release.py")], capture_output=True, text=True, env=env,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.split("RESULT ", 1)[1])


@pytest.mark.parametrize("hooked", [True, False], ids=["hooked", "sglang-alone"])
@pytest.mark.parametrize("sglang_dir", DIRS)
def test_release_and_per_request_metrics_through_sglangs_own_classes(sglang_dir, hooked):
    """With the hooks: the prefix cache keeps only tokens whose draft KV exists, never trims into the prefix it
    already holds, leaks nothing, frees nothing twice, hands every released slot back clean, and the per-request
    metrics leave off steps out. Without them: SGLang's own behaviour, for contrast."""
    version, adapter = _release(sglang_dir)
    if adapter is None:  # test_plugin checks that such a release refuses true-off cleanly
        pytest.skip(f"no true-off adapter was written for SGLang {version}")
    rel = RELEASES[adapter.LINE]
    r = run_release_check(sglang_dir, hooked)
    assert (r["version"], r["adapter"]) == (version, adapter.LINE)  # the release's own adapter, picked by contract
    # every release-path target of the adapter is wrapped by the plugin's hook (sglang-steps0: none is)
    assert r["hooked"] and r["hooked"] == dict.fromkeys(r["hooked"], hooked)
    start = r["start_free"]
    first, turn, abort, stop = (r[k] for k in STEPS)

    # 1. 10 prompt + 6 output tokens committed, the last 3 decoded while off (their draft KV never written);
    # EAGLE's radix keys are bigrams, so 16 tokens make 15 keys and 13 make 12. A length finish: every release
    # reports all 16 tokens as the request's own.
    assert (first["owned"], first["finished_len"]) == (16, 6)
    kept = 12 if hooked else 15
    assert first["cached"] == kept and first["free_kv"] == start - kept
    # 2. the next turn re-prefills what the draft has no KV for: its hit is exactly what was kept
    assert turn["hit"] == first["cached"] == kept
    # it decodes all 8 of its tokens past the cached prefix while off: none of them is kept, and the cached prefix
    # itself stays whole (the trim stops at cache_protected_len + 1: a trim down to it made SGLang free a token
    # the cache owns)
    assert turn["cached"] == (12 if hooked else 19)
    # 3. an abort inserts nothing, and frees all 8 tokens it allocated
    assert abort["cached"] == turn["cached"] and abort["freed"] == 8 and abort["finished_len"] is None
    # 4. overlap: the speculative step that accepted [603, 699, 604] finished the request on the stop 699 while
    # the scheduler had already launched its next step as an off step (one buffered token, past the committed
    # 14). 0.5.23 owns 13 (up to the stop); 0.5.15/0.5.17 own all 14, so they cache 604 too. The hook trims the
    # one buffered token from what the release owns: one more than needed (that token's KV is past the owned
    # range), a conservative trim of a token whose draft KV exists, never one whose draft KV is missing.
    owned = 13 if rel["stop_trim"] else 14
    assert (stop["owned"], stop["finished_len"]) == (owned, 5)
    stop_kept = owned - 1 if hooked else owned
    assert stop["cached"] - stop["cached_before"] == stop_kept - 1  # bigram keys
    for step in (first, turn, abort, stop):
        # nothing leaked: every slot the tree does not hold is back in the allocator after each release
        assert step["free_kv"] + step["cached"] == start
        assert step["slot_free"] and step["slot_after"] is None
    # after evicting the tree: nothing leaked, nothing freed twice
    assert r["end_free"] == start and r["end_cached"] == 0

    slots = [r[k]["slot"] for k in STEPS]
    assert slots == ([4, 4, 4, 4] if rel["lifo"] else [1, 2, 3, 4])
    buffered = [3, 8, 2, 1]
    if hooked:
        # what the adapter's length hook asked of the gate, per release: [committed, protected, keep, counted]
        expected = [(16, 0, 13), (20, 12, 13), (7, 0, 5), (owned, 0, owned - 1)]
        for k, n, (committed, protected, keep) in zip(STEPS, buffered, expected, strict=True):
            step = r[k]
            assert keep == max(committed - n, protected + 1) and keep >= protected + 1  # never into the cached prefix
            assert step["asked"] == [[committed, protected, keep, True]] + [[committed, protected, keep, False]] * (
                rel["asks"] - 1
            )
            # the released slot starts clean for whoever gets it next (in 0.5.23 the next request gets this very row)
            assert step["reset"] == [step["slot"]]
            assert step["n_start"] == 0 and step["n_after"] == 0 and not step["len_ok_after"]
        assert r["counters"] == {"released": 4, "trimmed_requests": 4, "trimmed_tokens": 3 + 7 + 2 + 1}
    else:
        assert all(r[k]["asked"] == [] and r[k]["reset"] == [] for k in STEPS)  # no hook ran
        assert [r[k]["n_after"] for k in STEPS] == buffered  # nothing resets a released slot
        # 0.5.23 hands the same row out again: the stale count of its last holder would still be there
        assert [r[k]["n_start"] for k in STEPS] == ([0, 3, 8, 2] if rel["lifo"] else [0, 0, 0, 0])
        assert r["counters"] == {"released": 0, "trimmed_requests": 0, "trimmed_tokens": 0}

    # two requests through an off step, a speculative step (3 and 1 accepted) and another off step
    per_request = [(q["verify_ct"], q["histogram"], q["committed"]) for q in r["per_request"]]
    if hooked:  # the off steps are no verify steps
        assert per_request == [(1, [0, 0, 1], 5), (1, [1], 3)]
        assert r["meta_info"]["spec_accept_length"] == 2.5  # 1 + 3 correct drafts / 2 verify steps
    else:  # SGLang alone counts them as verify steps that accepted nothing
        assert per_request == [(3, [2, 0, 1], 5), (3, [3], 3)]
        assert r["meta_info"]["spec_accept_length"] == 4.5  # completion tokens / verify steps
