"""The closed-loop benchmark client against a real reference-engine server on 127.0.0.1."""

import asyncio

import pytest
from test_server import server  # noqa: F401  (the module-scoped reference server fixture)

from specgate.sweep.load_client import LevelFailed, bench_prompts, sweep_levels

pytestmark = pytest.mark.slow

EVAL = [{"messages": [{"role": "system", "content": "count"}, {"role": "user", "content": f"{i} {i + 1} {i + 2}"},
                      {"role": "assistant", "content": "x"}]} for i in range(10)]  # fmt: skip


def test_prompts_are_a_seeded_mix_cut_after_the_first_user_turn():
    a, b = bench_prompts(EVAL, 6, seed=1), bench_prompts(EVAL, 6, seed=1)
    assert a == b and len(a) == 6 and a != bench_prompts(EVAL, 6, seed=2)
    assert all(p[-1]["role"] == "user" and p[0]["role"] == "system" for p in a)


def test_levels_record_every_request_and_summarise_like_bench_serving(server):  # noqa: F811
    records, rows = asyncio.run(sweep_levels(
        server.url, "m", bench_prompts(EVAL, 10, 0), [1, 4], variant="gate_4", num_requests=lambda c: 2 * c,
        warmup_requests=1, max_tokens=12, ignore_eos=True, max_error_rate=0.0))  # fmt: skip
    assert [r["concurrency"] for r in rows] == [1, 4]
    assert len(records) == 2 + 8 and all(r["error"] is None and r["output_tokens"] == 12 for r in records)
    for rec in records:
        # the first chunk is the TTFT; every later chunk one inter-token gap, all within the E2E latency.
        # (The counting model emits byte tokens that the server holds back until they decode, so a request
        # may stream fewer chunks than steps.)
        assert 0 < rec["ttft_s"] <= rec["e2e_s"] and len(rec["itl_s"]) <= 11
        assert rec["ttft_s"] + sum(rec["itl_s"]) <= rec["e2e_s"]
    for row in rows:
        assert row["completed"] == 2 * row["concurrency"] and row["failed"] == 0
        assert row["total_output_tokens"] == 12 * row["completed"]
        assert row["output_throughput"] == pytest.approx(row["total_output_tokens"] / row["duration"])
        for key in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "mean_e2e_latency_ms"):
            assert row[key] > 0, key
        assert row["accept_length_source"] == "server counters, this level"
    # the gate at 4 speculates at concurrency 1 (accepting more than 1 token per verify) and is
    # off for most steps at concurrency 4
    assert rows[0]["accept_length"] > 1.0 and rows[0]["gate_steps_off"] == 0
    assert rows[1]["gate_steps_off"] > rows[1]["gate_steps_on"]
    # the level's own switches; a fixed gate has no probes, and the reference engine no true-off flushes
    assert rows[0]["gate_switches"] == 0 and rows[1]["gate_switches"] >= 1
    assert rows[1]["gate_probes"] is None and rows[1]["gate_flushes"] is None


def test_a_prime_burst_switches_the_gate_off_and_on_before_the_levels(server):  # noqa: F811
    from specgate.sweep.load_client import server_info

    before = asyncio.run(server_info(server.url))["gate"]
    records, rows = asyncio.run(sweep_levels(
        server.url, "m", bench_prompts(EVAL, 10, 0), [1], variant="gate_4", num_requests=lambda c: 2,
        warmup_requests=0, max_tokens=12, ignore_eos=True, max_error_rate=0.0, prime=5))  # fmt: skip
    after = asyncio.run(server_info(server.url))["gate"]
    assert after["steps_off"] > before["steps_off"]  # the burst ran with the gate off
    # and is not measured: the level has its 2 requests and speculates throughout
    assert len(records) == 2 and rows[0]["gate_steps_off"] == 0 and rows[0]["gate_steps_on"] > 0
    # its first speculative steps follow the burst's off period: counted as "after resuming", this level's only
    assert 0 < rows[0]["spec_verify_resumed"] <= rows[0]["spec_verify"]
    assert rows[0]["spec_accepted_resumed"] >= rows[0]["spec_verify_resumed"]


def test_a_level_over_the_error_bound_fails_with_the_reason(server):  # noqa: F811
    with pytest.raises(LevelFailed, match=r"gate_4 at concurrency 2: 4 of 4 requests failed .*HTTP 400"):
        asyncio.run(sweep_levels(server.url, "m", bench_prompts(EVAL, 4, 0), [2], variant="gate_4",
                                 num_requests=lambda c: 4, warmup_requests=0, max_tokens=100000, ignore_eos=True,
                                 max_error_rate=0.25))  # fmt: skip


def test_identity_schedule_crosses_the_gate_and_matches_no_spec(server, counting_target, tmp_path):  # noqa: F811
    from test_server import serve_cmd

    from specgate.sweep.load_client import compare_outputs, identity_schedule, run_schedule, server_info
    from specgate.sweep.managed_server import ManagedServer, free_port

    jobs = identity_schedule(10, waves=2, per_wave=6, gap_s=1.0)
    assert len(jobs) == 12 and len({j["max_tokens"] for j in jobs}) > 4  # staggered: the batch shrinks past 4
    jobs = [dict(j, max_tokens=4 + j["max_tokens"] // 8) for j in jobs]
    prompts = bench_prompts(EVAL, 10, 0)
    before = asyncio.run(server_info(server.url))
    gated = asyncio.run(run_schedule(server.url, "m", prompts, jobs))
    after = asyncio.run(server_info(server.url))
    port = free_port()
    with ManagedServer(serve_cmd(counting_target, None, port), port, tmp_path / "nospec.log", ready_timeout=120) as s:
        plain = asyncio.run(run_schedule(s.url, "m", prompts, jobs))
        one_by_one = asyncio.run(run_schedule(s.url, "m", prompts, jobs, sequential=True))
    assert all("text" in r and r["tokens"] == j["max_tokens"] for r, j in zip(gated, jobs, strict=True))
    assert after["gate"]["switches"] - before["gate"]["switches"] >= 2  # off and back on
    assert compare_outputs(plain, gated) == {"requests": 12, "identical": 12, "differ": []}
    assert compare_outputs(one_by_one, plain)["identical"] == 12
    changed = [dict(r, text=r["text"] + "!") if i == 3 else r for i, r in enumerate(gated)]
    assert compare_outputs(plain, changed)["differ"][0]["first_diff_char"] == len(plain[3]["text"])
