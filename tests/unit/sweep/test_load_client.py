"""The block benchmark client against real reference-engine servers on 127.0.0.1."""

import asyncio
import sys
import time

import pytest

from specgate.sweep.load_client import (
    Entry,
    LevelFailed,
    Load,
    bench_requests,
    closed_block,
    open_block,
    poisson_arrivals,
    server_info,
    summarize_block,
    sweep_blocks,
    wait_idle,
)
from specgate.sweep.managed_server import ManagedServer, free_port

pytestmark = pytest.mark.slow

EVAL = [{"messages": [{"role": "system", "content": "count"}, {"role": "user", "content": f"{i} {i + 1} {i + 2}"},
                      {"role": "assistant", "content": "x " * (3 + i)}]} for i in range(10)]  # fmt: skip


def _serve(target, draft, tmp, name, extra=()):
    port = free_port()
    cmd = [sys.executable, "-m", "specgate.cli", "serve", "--target", str(target), "--port", str(port), "--max-len",
           "512", "--max-running", "8", *(["--draft", str(draft)] if draft else []), *extra]  # fmt: skip
    return ManagedServer(cmd, port, tmp / f"{name}.log", ready_timeout=120)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, counting_target, tiny_drafter):
    """A no-spec server and a speculative one whose gate is switched through a control file."""
    tmp = tmp_path_factory.mktemp("servers")
    control = tmp / "gate_control.json"
    with _serve(counting_target, None, tmp, "nospec") as base, \
         _serve(counting_target, tiny_drafter, tmp, "spec", ["--gate-control", str(control)]) as spec:  # fmt: skip
        yield base, spec, control


def test_requests_are_a_seeded_mix_cut_after_the_first_user_turn_with_their_replies():
    a, b = bench_requests(EVAL, 6, seed=1), bench_requests(EVAL, 6, seed=1)
    assert a == b and len(a) == 6 and a != bench_requests(EVAL, 6, seed=2)
    assert all(p[-1]["role"] == "user" and p[0]["role"] == "system" for p, _ in a)
    # each prompt keeps the reply that followed it in the eval conversation
    assert all(reply == "x " * (3 + int(p[-1]["content"].split()[0])) for p, reply in a)


def test_reply_lengths_are_the_target_tokens_of_each_reply_truncated_at_max_tokens(smollm2_tokenizer):
    from specgate.sweep.load_client import reply_lengths

    replies = ["", "hello", "one two three four five six seven eight nine ten " * 4]
    lengths = reply_lengths(replies, smollm2_tokenizer, max_tokens=16)
    assert lengths[0] == 1 and lengths[1] == len(smollm2_tokenizer("hello", add_special_tokens=False)["input_ids"])
    assert lengths[2] == 16


def test_poisson_arrivals_repeat_for_a_seed_and_have_the_rate():
    a = poisson_arrivals(5.0, 200.0, seed=3)
    assert a == poisson_arrivals(5.0, 200.0, seed=3) and a != poisson_arrivals(5.0, 200.0, seed=4)
    assert all(0 <= x < 200 for x in a) and a == sorted(a)
    assert abs(len(a) / 200 - 5.0) < 0.5


def test_a_closed_block_counts_the_tokens_streamed_in_its_steady_window_and_leaves_the_server_idle(servers):
    base, _, _ = servers
    prompts = [p for p, _ in bench_requests(EVAL, 10, 0)]
    lengths = [400, 7, 13, 400, 22, 9, 31, 5, 17, 26]
    block = asyncio.run(closed_block(base.url, "m", prompts, lengths, 3, warmup_s=0.3, window_s=1.5, stagger=True))
    t_end = time.perf_counter()
    recs = block.records
    # request k asked for the prompt and length of list entry k; worker j's first one for (j + 1)/3 of it
    assert [r.index for r in recs] == [k % 10 for k in range(len(recs))]
    assert [r.max_tokens for r in recs[:3]] == [134, 5, 13] and [r.staggered for r in recs[:4]] == [True] * 3 + [False]
    assert [r.max_tokens for r in recs[3:]] == [lengths[r.index] for r in recs[3:]]
    assert len(recs) > 3 and block.window_start_s >= 0.3 and block.window_s == pytest.approx(1.5, abs=0.1)
    # the window's tokens are the per-chunk counts between its ends: fewer than the whole block's, more than 0
    t0, t1 = block.window_start_s, block.window_start_s + block.window_s
    assert block.window_tokens == sum(r.tokens_by(t1) - r.tokens_by(t0) for r in recs)
    assert 0 < block.window_tokens < block.whole_tokens
    done = [r for r in recs if not r.cancelled]
    assert all(r.error is None and r.output_tokens == r.max_tokens for r in done)  # continuous usage is exact
    assert all(r.chunk_tokens == sorted(r.chunk_tokens) for r in recs)
    # what was in flight at the end was cancelled, not failed, and the server stopped decoding for it
    assert 1 <= sum(r.cancelled for r in recs) <= 3
    asyncio.run(wait_idle(base.url, timeout_s=5))
    assert asyncio.run(server_info(base.url))["running"] == 0 and time.perf_counter() - t_end < 5
    assert any(r.cancelled and r.max_tokens == 400 and r.output_tokens < 400 for r in recs)
    row = summarize_block(block)
    assert row["failed"] == 0 and row["cancelled"] >= 1
    assert row["output_throughput"] == pytest.approx(block.window_tokens / block.window_s)


def test_an_open_block_runs_every_arrival_to_its_end_and_counts_goodput_under_the_slo(servers):
    base, _, _ = servers
    prompts = [p for p, _ in bench_requests(EVAL, 10, 0)]
    lengths = [8] * 10
    block = asyncio.run(open_block(base.url, "m", prompts, lengths, 4.0, window_s=1.5, seed=1))
    assert len(block.records) == len(poisson_arrivals(4.0, 1.5, seed=1))
    assert all(r.error is None and not r.cancelled and r.output_tokens == 8 for r in block.records)
    loose, tight = summarize_block(block, {"tpot_ms": 10_000}), summarize_block(block, {"ttft_ms": 1e-6})
    assert loose["goodput"] == pytest.approx(len(block.records) / block.whole_s) and tight["goodput"] == 0


def test_a_switched_sweep_runs_every_gate_on_one_server_beside_the_no_spec_server(servers, caplog):
    base, spec, control = servers
    caplog.set_level("INFO", logger="specgate.sweep.load_client")
    prompts = [p for p, _ in bench_requests(EVAL, 10, 0)]
    lengths = [24] * 10
    entries = [Entry("nospec", base.url, baseline=True),
               Entry("always", spec.url, gate={"disable_at": None}, control=str(control)),
               Entry("gate_2", spec.url, gate={"disable_at": 2}, control=str(control), prime=3)]  # fmt: skip
    records, rows = asyncio.run(sweep_blocks(entries, "m", prompts, lengths, [Load(concurrency=1), Load(concurrency=3)],
                                             blocks=2, warmup_s=0.2, window_s=0.8, rate_window_s=1.0, ignore_eos=True,
                                             max_error_rate=0.0))  # fmt: skip
    assert len(rows) == 2 * 2 * 3
    by = {(r["variant"], r["concurrency"], r["block"]): r for r in rows}
    # a sandwich: each turn is nospec, v, nospec, w, nospec, the variants' order rotating from one turn to the next
    assert [(r["variant"], r["position"]) for r in rows[:3]] == [("nospec", 0), ("always", 1), ("gate_2", 3)]
    assert [(r["variant"], r["position"]) for r in rows[3:6]] == [("nospec", 0), ("gate_2", 1), ("always", 3)]
    for c in (1, 3):
        for b in (0, 1):
            nospec, always, gate = by[("nospec", c, b)], by[("always", c, b)], by[("gate_2", c, b)]
            assert nospec["ratio"] == 1.0
            # each ratio divides by the mean of the no-spec blocks on either side: the turn's first is one of them
            assert always["ratio"] == pytest.approx(always["output_throughput"] / always["baseline_output_throughput"])
            first_beside = always if always["position"] == 1 else gate
            assert min(nospec["output_throughput"], 2 * first_beside["baseline_output_throughput"]
                       - nospec["output_throughput"]) > 0  # fmt: skip
            # the switch took effect before the block: always-on speculates on every step, as the server's own
            # step counters show, and the no-spec server runs plain steps only
            assert always["gate_steps_off"] == 0 and always["server_spec_steps"] > 0 and always["server_plain_steps"] == 0
            assert nospec["server_spec_steps"] == 0 and nospec["server_plain_ms"] > 0
            assert always["accept_length"] > 1.0
    # gate_2 speculates at concurrency 1 and runs plain steps at 3 (its prime crossed the threshold before)
    assert all(by[("gate_2", 1, b)]["server_plain_steps"] == 0 for b in (0, 1))
    assert all(by[("gate_2", 3, b)]["server_spec_steps"] == 0 and by[("gate_2", 3, b)]["server_plain_ms"] > 0
               for b in (0, 1))  # fmt: skip
    assert {r["variant"] for r in records} == {"nospec", "always", "gate_2"}
    # each level began with one unmeasured block per server, the speculative one always on
    warm = [m for m in caplog.messages if m.startswith("unmeasured block")]
    assert warm == [f"unmeasured block: {v} at c={c}" for c in (1, 3) for v in ("nospec", "always")]


def test_turn_orders_rotate_or_sandwich_each_variant_between_baseline_blocks():
    from specgate.sweep.load_client import baseline_beside, turn_order

    n, a, b = Entry("nospec", "u", baseline=True), Entry("a", "v"), Entry("b", "v")
    assert [e.name for e in turn_order([n, a, b], 1, "rotate")] == ["a", "b", "nospec"]
    assert [e.name for e in turn_order([n, a, b], 0, "sandwich")] == ["nospec", "a", "nospec", "b", "nospec"]
    assert [e.name for e in turn_order([n, a, b], 1, "sandwich")] == ["nospec", "b", "nospec", "a", "nospec"]
    row = lambda t: {"output_throughput": t, "whole_throughput": t}  # noqa: E731
    measured = [(n, row(10.0), []), (a, row(12.0), []), (n, row(14.0), []), (b, row(9.0), []), (n, row(8.0), [])]
    assert baseline_beside(measured, 1)["output_throughput"] == 12.0 and baseline_beside(measured, 3)["output_throughput"] == 11.0
    assert baseline_beside(measured, 0)["output_throughput"] == 10.0
    rotated = [(a, row(12.0), []), (n, row(10.0), []), (b, row(9.0), [])]
    assert baseline_beside(rotated, 2)["output_throughput"] == 10.0


def test_a_paired_entry_reports_its_own_baseline_and_a_failing_server_fails_the_level(servers):
    base, spec, control = servers
    prompts = [p for p, _ in bench_requests(EVAL, 10, 0)]
    entries = [Entry("always", spec.url, gate={"disable_at": None}, control=str(control)),
               Entry("nospec", base.url, baseline=True, emit=False)]  # fmt: skip
    _, rows = asyncio.run(sweep_blocks(entries, "m", prompts, [16] * 10, [Load(concurrency=2)], blocks=2, warmup_s=0.2,
                                       window_s=0.6, rate_window_s=1.0, ignore_eos=True, max_error_rate=0.0,
                                       order="rotate"))  # fmt: skip
    assert [r["variant"] for r in rows] == ["always", "always"] and [r["position"] for r in rows] == [0, 1]
    assert all(r["ratio"] == pytest.approx(r["output_throughput"] / r["baseline_output_throughput"]) for r in rows)
    # a request the server refuses (longer than its context) is a failure, and the level stops
    with pytest.raises(LevelFailed, match="failed"):
        asyncio.run(sweep_blocks([Entry("nospec", base.url, baseline=True)], "m", prompts, [600] * 10,
                                 [Load(concurrency=1)], blocks=1, warmup_s=0.1, window_s=0.3, rate_window_s=1.0,
                                 ignore_eos=True, max_error_rate=0.0))  # fmt: skip
