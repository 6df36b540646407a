"""Closed-loop load generator over the OpenAI-compatible streaming API.

The same client drives SGLang and the reference engine. At concurrency c exactly c
requests are in flight: a finished request is replaced at once, until the level's
request count is done. Per request it records TTFT, every inter-token latency (the gap
between streamed chunks; one chunk may carry several tokens when a speculative step
accepts several), end-to-end latency, output tokens (from the final `usage` chunk) and
the error, if any. Per level it summarises with the field names of `sglang.bench_serving`.

The accept length of a level comes from the server's counters before and after it:
exact where the server reports its totals (the reference engine), otherwise SGLang's
cumulative `avg_spec_accept_length` read at the end of the level (labelled as such).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field

import aiohttp
import numpy as np


@dataclass
class RequestRecord:
    variant: str
    concurrency: int
    index: int
    start_s: float = 0.0  # since the level started
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None


class LevelFailed(RuntimeError):
    pass


def bench_prompts(eval_records: list[dict], n: int, seed: int) -> list[list[dict]]:
    """A seeded mix of eval conversations, each cut after its first user turn."""
    prompts = []
    for rec in eval_records:
        msgs = rec["messages"]
        first_user = next(i for i, m in enumerate(msgs) if m["role"] == "user")
        prompts.append(msgs[: first_user + 1])
    random.Random(seed).shuffle(prompts)
    if not prompts:
        raise ValueError("no eval prompts to benchmark with")
    return prompts[:n]


async def one_request(session: aiohttp.ClientSession, url: str, model: str, messages: list[dict], max_tokens: int,
                      ignore_eos: bool, rec: RequestRecord, t_level: float) -> RequestRecord:  # fmt: skip
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}  # fmt: skip
    t0 = time.perf_counter()
    rec.start_s = t0 - t_level
    last = None
    chunks = 0
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return rec
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    rec.error = str(msg["error"])[:200]
                    break
                if msg.get("usage"):
                    rec.output_tokens = msg["usage"].get("completion_tokens", rec.output_tokens)
                delta = (msg.get("choices") or [{}])[0].get("delta", {})
                if delta.get("content"):
                    now = time.perf_counter()
                    if last is None:
                        rec.ttft_s = now - t0
                    else:
                        rec.itl_s.append(now - last)
                    last = now
                    chunks += 1
        rec.e2e_s = time.perf_counter() - t0
        if not rec.output_tokens:
            rec.output_tokens = chunks  # server without usage: one token per chunk is the best estimate
        if rec.error is None and rec.ttft_s is None:
            rec.error = "no tokens streamed"
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:200]
    return rec


def spread_length(max_tokens: int, spread: float, i: int) -> int:
    """Request i's output length: max_tokens x (1 - spread/2 + spread x u_i), u_i uniform, the same for every
    variant. With one length for all, plain steps keep a closed loop's requests in step and their successors
    share one prefill, while speculation staggers them into a prefill each (on an H200, 8B shape, c = 8:
    626 prefill passes against 269); real arrivals are not in step."""
    if spread <= 0:
        return max_tokens
    return max(1, round(max_tokens * (1 - spread / 2 + spread * random.Random(i).random())))


async def closed_loop(url: str, model: str, prompts: list[list[dict]], concurrency: int, num_requests: int, *,
                      max_tokens: int, ignore_eos: bool, variant: str = "", timeout_s: float = 600,
                      length_spread: float = 0.0):  # fmt: skip
    """Run `num_requests` with `concurrency` in flight; returns (records, wall seconds)."""
    records = [RequestRecord(variant, concurrency, i) for i in range(num_requests)]
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(num_requests):
        queue.put_nowait(i)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        t_level = time.perf_counter()

        async def worker():
            while not queue.empty():
                i = queue.get_nowait()
                length = spread_length(max_tokens, length_spread, i)
                await one_request(session, url, model, prompts[i % len(prompts)], length, ignore_eos, records[i], t_level)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return records, time.perf_counter() - t_level


async def server_info(url: str) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        async with s.get(f"{url}/server_info") as r:
            return await r.json()


def gate_counters(info: dict) -> dict:
    """The gate's counters: the reference engine's `gate`, or the specgate plugin's entry in SGLang's
    internal_states (true-off mode); {} for a server without a gate."""
    if info.get("gate"):
        return info["gate"]
    states = info.get("internal_states") or [{}]
    return states[0].get("specgate_gate") or {}


def settled_threshold(gate: dict) -> int | None:
    """The auto gate's threshold now: the smallest batch at which it would stop speculating (None: it
    speculates at every batch, or the gate is not the auto gate). Both engines report it as
    `auto_threshold`; the plugin's `mode` names the gate's path (true-off), not its policy."""
    return gate.get("auto_threshold")


def accept_length(before: dict, after: dict) -> tuple[float | None, str]:
    """(accept length over the level, where it came from)."""
    if "spec_verify_steps" in after and "spec_accepted_tokens" in after:
        steps = after["spec_verify_steps"] - before.get("spec_verify_steps", 0)
        toks = after["spec_accepted_tokens"] - before.get("spec_accepted_tokens", 0)
        return (toks / steps if steps else None), "server counters, this level"
    gate_after = gate_counters(after)
    if "accepted_tokens_on" in gate_after:  # SGLang with the true-off gate: speculative steps only
        gate_before = gate_counters(before)
        steps = gate_after["verify_request_steps_on"] - gate_before.get("verify_request_steps_on", 0)
        toks = gate_after["accepted_tokens_on"] - gate_before.get("accepted_tokens_on", 0)
        return (toks / steps if steps else None), "gate counters, speculative steps of this level"
    states = after.get("internal_states") or [{}]
    return states[0].get("avg_spec_accept_length"), "server cumulative average"


def spec_counts(info: dict) -> dict | None:
    """Cumulative speculative counts, in request-steps: all, and those within the first RESUMED_STEPS
    speculative steps after the gate turned back on. The reference engine's own counters or the SGLang
    true-off gate's; None for a server that has neither (SGLang without the plugin)."""
    if "spec_verify_steps_resumed" in info:
        return {"verify": info["spec_verify_steps"], "accepted": info["spec_accepted_tokens"],
                "verify_resumed": info["spec_verify_steps_resumed"],
                "accepted_resumed": info["spec_accepted_tokens_resumed"]}  # fmt: skip
    gate = gate_counters(info)
    if "verify_request_steps_resumed" in gate:
        return {"verify": gate["verify_request_steps_on"], "accepted": gate["accepted_tokens_on"],
                "verify_resumed": gate["verify_request_steps_resumed"],
                "accepted_resumed": gate["accepted_tokens_resumed"]}  # fmt: skip
    return None


def _ms(values, q=None):
    if not values:
        return None
    arr = np.asarray(values) * 1000
    return float(np.mean(arr)) if q is None else float(np.percentile(arr, q))


def summarize(records: list[RequestRecord], duration_s: float, variant: str, concurrency: int) -> dict:
    ok = [r for r in records if r.error is None]
    out_tokens = sum(r.output_tokens for r in ok)
    ttft = [r.ttft_s for r in ok]
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl_s]
    e2e = [r.e2e_s for r in ok]
    row = {"variant": variant, "concurrency": concurrency, "completed": len(ok), "failed": len(records) - len(ok),
           "error_rate": (len(records) - len(ok)) / max(len(records), 1), "duration": duration_s,
           "total_output_tokens": out_tokens, "request_throughput": len(ok) / duration_s,
           "output_throughput": out_tokens / duration_s}  # fmt: skip
    for name, vals in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e_latency", e2e)):
        row[f"mean_{name}_ms"] = _ms(vals)
        row[f"median_{name}_ms"] = _ms(vals, 50)
        row[f"p90_{name}_ms"] = _ms(vals, 90)
        row[f"p99_{name}_ms"] = _ms(vals, 99)
    errors = sorted({r.error for r in records if r.error})
    row["errors"] = "; ".join(errors)[:300]
    return row


async def sweep_levels(url: str, model: str, prompts: list[list[dict]], levels: list[int], *, variant: str,
                       num_requests, warmup_requests: int, max_tokens: int, ignore_eos: bool,
                       max_error_rate: float, timeout_s: float = 600, progress=None, prime: int = 0,
                       length_spread: float = 0.0):  # fmt: skip
    """All concurrency levels in order against one server: (per-request records, summary rows).

    `num_requests(c)` gives the request count of level c. A level whose error rate exceeds
    `max_error_rate` raises LevelFailed after its records are kept. `prime` > 0: one unmeasured burst
    of that many concurrent requests first. A gated server given a burst above its threshold turns
    off and back on before any level. One-time costs of that path then stay out of the levels: on
    an H200 the first off step of an SGLang true-off server stalled for 10.4 s.
    """
    all_records, rows = [], []
    if prime:
        await closed_loop(url, model, prompts, prime, prime, max_tokens=max_tokens, ignore_eos=ignore_eos,
                          variant=variant, timeout_s=timeout_s, length_spread=length_spread)  # fmt: skip
    for c in levels:
        if warmup_requests:
            await closed_loop(url, model, prompts, min(c, warmup_requests), warmup_requests, max_tokens=max_tokens,
                              ignore_eos=ignore_eos, variant=variant, timeout_s=timeout_s,
                              length_spread=length_spread)  # fmt: skip
        before = await server_info(url)
        records, duration = await closed_loop(url, model, prompts, c, num_requests(c), max_tokens=max_tokens,
                                              ignore_eos=ignore_eos, variant=variant, timeout_s=timeout_s,
                                              length_spread=length_spread)  # fmt: skip
        after = await server_info(url)
        row = summarize(records, duration, variant, c)
        row["accept_length"], row["accept_length_source"] = accept_length(before, after)
        gate, gate_before = gate_counters(after), gate_counters(before)
        row["auto_threshold"] = settled_threshold(gate)
        # the level's own counts; probes are the auto gate's, flushes SGLang's true-off buffers'
        for key in ("steps_on", "steps_off", "switches", "probes", "flushes"):
            row[f"gate_{key}"] = gate[key] - gate_before.get(key, 0) if key in gate else None
        counts, counts_before = spec_counts(after), spec_counts(before) or {}
        for key in ("verify", "accepted", "verify_resumed", "accepted_resumed"):  # this level's, for the report
            row[f"spec_{key}"] = counts[key] - counts_before.get(key, 0) if counts else None
        all_records += [asdict(r) for r in records]
        rows.append(row)
        if progress:
            progress(row)
        if row["error_rate"] > max_error_rate:
            raise LevelFailed(f"{variant} at concurrency {c}: {row['failed']} of {len(records)} requests failed "
                              f"(error rate {row['error_rate']:.2f} > bench.max_error_rate {max_error_rate}): "
                              f"{row['errors']}")  # fmt: skip
    return all_records, rows


# -- greedy identity across gate switches ------------------------------------------------------


def identity_schedule(num_prompts: int, waves: int = 3, per_wave: int = 12, gap_s: float = 1.5) -> list[dict]:
    """Bursts of greedy requests with staggered lengths: each burst drives the batch above a small
    threshold, and its requests finish one by one, so the gate switches off, then on, every wave."""
    jobs = []
    for w in range(waves):
        for i in range(per_wave):
            jobs.append({"wave": w, "start_s": w * gap_s, "prompt": (w * per_wave + i) % num_prompts,
                         "max_tokens": 8 + 10 * ((i * 7 + w) % per_wave)})  # fmt: skip
    return jobs


async def run_schedule(url: str, model: str, prompts: list[list[dict]], jobs: list[dict], timeout_s: float = 600,
                       sequential: bool = False) -> list[dict]:  # fmt: skip
    """Send each job at its start time (greedy, ignore_eos), or one after another; outputs in job order."""

    async def one(session, job, t0):
        await asyncio.sleep(max(0.0, t0 + job["start_s"] - time.perf_counter()))
        body = {"model": model, "messages": prompts[job["prompt"]], "max_tokens": job["max_tokens"],
                "temperature": 0.0, "ignore_eos": True}  # fmt: skip
        async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
            data = await resp.json()
            if resp.status != 200:
                return {**job, "error": f"HTTP {resp.status}: {str(data)[:200]}"}
        return {**job, "text": data["choices"][0]["message"]["content"], "tokens": data["usage"]["completion_tokens"]}

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        if sequential:
            return [await one(session, {**j, "start_s": 0.0}, time.perf_counter()) for j in jobs]
        t0 = time.perf_counter()
        return list(await asyncio.gather(*(one(session, j, t0) for j in jobs)))


def compare_outputs(reference: list[dict], candidate: list[dict]) -> dict:
    """Requests whose greedy text differs from the reference's, with where the first difference is."""
    diffs = []
    for r, c in zip(reference, candidate, strict=True):
        if r.get("text") != c.get("text"):
            a, b = r.get("text") or "", c.get("text") or ""
            at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            diffs.append({"prompt": r["prompt"], "max_tokens": r["max_tokens"], "first_diff_char": at,
                          "error": c.get("error") or r.get("error")})  # fmt: skip
    return {"requests": len(reference), "identical": len(reference) - len(diffs), "differ": diffs}
