"""Load generator over the OpenAI-compatible streaming API, in time-boxed blocks.

The same client drives SGLang and the reference engine. A *block* is one stretch of load on one
server:

- closed loop at concurrency c: c workers, each sending its next request as soon as the last one
  ends. The block warms up for `warmup_s` and until every first request has streamed its first
  token, then counts the tokens streamed during the next `window_s` seconds (the steady window),
  then cancels what is in flight. Ramp-up and drain stay outside the window, so the phase of the
  load's waves does not enter the figure. The whole block's figure (ramp included) is kept beside it.
  With `stagger`, worker j's first request asks for (j + 1)/c of its length, so the first requests
  end one after another as in a loop that has run for a while, and the window sees the loop's
  refills (their prefills) as the steady state has them. Without it every first request starts
  together, and a window shorter than a request's life sees decode steps only.
- open loop at a request rate: Poisson arrivals for `window_s` seconds (the convention of
  `sglang.bench_serving --request-rate`), then every request runs to its end; latencies at p50 and
  p99, and goodput under an SLO.

Request k of a block asks for the prompt and the output length of request `start + k` of a fixed
list, so two servers given the same block see the same requests in the same order. Token counts
per chunk come from `stream_options.continuous_usage_stats` (both engines send the running
`completion_tokens` with each chunk); a server without it counts one token per chunk.

The accept length of a block comes from the server's counters before and after it: exact where the
server reports its totals (the reference engine, the true-off gate), otherwise SGLang's cumulative
`avg_spec_accept_length` (labelled as such).
"""

from __future__ import annotations

import asyncio
import bisect
import json
import logging
import random
import time
from dataclasses import asdict, dataclass, field

import aiohttp
import numpy as np

log = logging.getLogger(__name__)


@dataclass
class RequestRecord:
    variant: str
    concurrency: int | None
    index: int  # into the block's request list
    start_s: float = 0.0  # since the block started
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    max_tokens: int = 0
    error: str | None = None
    cancelled: bool = False  # still running when its closed-loop block ended: not an error
    staggered: bool = False  # a closed-loop block's first request of a worker, cut to stagger the ends
    chunk_t: list[float] = field(default_factory=list, repr=False)  # since the block started
    chunk_tokens: list[int] = field(default_factory=list, repr=False)  # cumulative completion tokens

    def tokens_by(self, t: float) -> int:
        """Tokens this request had streamed by block time t."""
        i = bisect.bisect_right(self.chunk_t, t)
        return self.chunk_tokens[i - 1] if i else 0

    def to_dict(self) -> dict:
        d = asdict(self)
        del d["chunk_t"], d["chunk_tokens"]
        return d


class LevelFailed(RuntimeError):
    pass


def bench_prompts(eval_records: list[dict], n: int, seed: int) -> list[list[dict]]:
    """A seeded mix of eval conversations, each cut after its first user turn."""
    return [p for p, _ in bench_requests(eval_records, n, seed)]


def bench_requests(eval_records: list[dict], n: int, seed: int) -> list[tuple[list[dict], str]]:
    """(prompt, its reply) for a seeded mix of eval conversations: each is cut after its first user
    turn, and the reply is the assistant turn that followed it ("" where none did)."""
    out = []
    for rec in eval_records:
        msgs = rec["messages"]
        first_user = next(i for i, m in enumerate(msgs) if m["role"] == "user")
        reply = next((m["content"] for m in msgs[first_user + 1 :] if m["role"] == "assistant"), "")
        out.append((msgs[: first_user + 1], reply))
    random.Random(seed).shuffle(out)
    if not out:
        raise ValueError("no eval prompts to benchmark with")
    return out[:n]


def reply_lengths(replies: list[str], tokenizer, max_tokens: int) -> list[int]:
    """Each request's output length: its eval reply's length in the target's tokens, truncated at
    max_tokens (at least 1). Real replies end at different lengths, so a closed loop's requests do
    not finish, and refill, in step."""
    return [max(1, min(max_tokens, len(tokenizer(r, add_special_tokens=False)["input_ids"]))) for r in replies]


async def one_request(session: aiohttp.ClientSession, url: str, model: str, messages: list[dict], max_tokens: int,
                      ignore_eos: bool, rec: RequestRecord, t_block: float) -> RequestRecord:  # fmt: skip
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}, "ignore_eos": ignore_eos}  # fmt: skip
    t0 = time.perf_counter()
    rec.start_s, rec.max_tokens = t0 - t_block, max_tokens
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
                usage = msg.get("usage") or {}
                delta = (msg.get("choices") or [{}])[0].get("delta", {})
                now = time.perf_counter()
                if delta.get("content"):
                    if last is None:
                        rec.ttft_s = now - t0
                    else:
                        rec.itl_s.append(now - last)
                    last = now
                    chunks += 1
                streamed = usage.get("completion_tokens", chunks if delta.get("content") else None)
                if streamed is not None and streamed > (rec.chunk_tokens[-1] if rec.chunk_tokens else 0):
                    rec.chunk_t.append(now - t_block)
                    rec.chunk_tokens.append(streamed)
                if usage:
                    rec.output_tokens = usage.get("completion_tokens", rec.output_tokens)
        rec.e2e_s = time.perf_counter() - t0
        if not rec.output_tokens:
            rec.output_tokens = chunks  # server without usage: one token per chunk is the best estimate
        if rec.error is None and rec.ttft_s is None:
            rec.error = "no tokens streamed"
    except asyncio.CancelledError:
        rec.cancelled = True
        rec.output_tokens = rec.chunk_tokens[-1] if rec.chunk_tokens else 0
        raise
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:200]
    return rec


@dataclass
class Block:
    """One block's requests and its two windows: the steady one and the whole block."""

    records: list[RequestRecord]
    window_start_s: float  # since the block started
    window_s: float
    window_tokens: int
    whole_s: float
    whole_tokens: int
    info_at_start: dict | None = None  # the server's /server_info at the steady window's ends (closed loop)
    info_at_end: dict | None = None

    @property
    def steady_throughput(self) -> float:
        return self.window_tokens / self.window_s if self.window_s > 0 else float("nan")

    @property
    def whole_throughput(self) -> float:
        return self.whole_tokens / self.whole_s if self.whole_s > 0 else float("nan")


async def closed_block(url: str, model: str, prompts: list[list[dict]], lengths: list[int], concurrency: int, *,
                       warmup_s: float, window_s: float, start: int = 0, ignore_eos: bool = True, variant: str = "",
                       timeout_s: float = 600, stagger: bool = False) -> Block:  # fmt: skip
    """Keep `concurrency` requests in flight; count the tokens streamed in the steady window. With
    `stagger`, worker j's first request is cut to (j + 1)/concurrency of its length (at least 1 token)."""
    n = len(prompts)
    records: list[RequestRecord] = []
    first_tokens = asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        t_block = time.perf_counter()

        async def worker():
            while True:
                k = len(records)
                rec = RequestRecord(variant, concurrency, (start + k) % n, staggered=stagger and k < concurrency)
                records.append(rec)
                length = lengths[rec.index]
                if rec.staggered:  # residual lengths spread over (0, L], as in a loop already running
                    length = max(1, -(-length * (k + 1) // concurrency))
                await one_request(session, url, model, prompts[rec.index], length, ignore_eos, rec, t_block)
                if rec.error is not None:
                    return  # a failing server: the block ends with its errors recorded

        async def watch_first_tokens():  # every first request streaming (or failed): the load is at c
            while sum(r.ttft_s is not None or r.error is not None for r in records[:concurrency]) < concurrency:
                await asyncio.sleep(0.01)
            first_tokens.set()

        tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
        watcher = asyncio.create_task(watch_first_tokens())
        await asyncio.sleep(warmup_s)
        try:
            await asyncio.wait_for(first_tokens.wait(), timeout_s)
        finally:
            watcher.cancel()
        t_start = time.perf_counter() - t_block
        info_start = await server_info(url)  # the server's counters over the same window as the tokens
        await asyncio.sleep(window_s)
        t_end = time.perf_counter() - t_block
        info_end = await server_info(url)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        whole_s = time.perf_counter() - t_block
    window_tokens = sum(r.tokens_by(t_end) - r.tokens_by(t_start) for r in records)
    whole_tokens = sum(r.chunk_tokens[-1] if r.chunk_tokens else 0 for r in records)
    return Block(records, t_start, t_end - t_start, window_tokens, whole_s, whole_tokens, info_start, info_end)


def poisson_arrivals(rate: float, seconds: float, seed: int) -> list[float]:
    """Arrival times in [0, seconds) of a Poisson process at `rate` per second, the same for a seed."""
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return out
        out.append(t)


async def open_block(url: str, model: str, prompts: list[list[dict]], lengths: list[int], rate: float, *,
                     window_s: float, seed: int, start: int = 0, ignore_eos: bool = True, variant: str = "",
                     timeout_s: float = 600) -> Block:  # fmt: skip
    """Poisson arrivals for `window_s` seconds; every request runs to its end. The steady window is the
    arrival span; the whole block runs until the last request ends."""
    n = len(prompts)
    arrivals = poisson_arrivals(rate, window_s, seed)
    records = [RequestRecord(variant, None, (start + k) % n) for k in range(len(arrivals))]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:  # fmt: skip
        t_block = time.perf_counter()

        async def send(rec, at):
            await asyncio.sleep(max(0.0, t_block + at - time.perf_counter()))
            await one_request(session, url, model, prompts[rec.index], lengths[rec.index], ignore_eos, rec, t_block)

        await asyncio.gather(*(send(r, a) for r, a in zip(records, arrivals, strict=True)))
        whole_s = time.perf_counter() - t_block
    window_tokens = sum(r.tokens_by(window_s) for r in records)
    whole_tokens = sum(r.chunk_tokens[-1] if r.chunk_tokens else 0 for r in records)
    return Block(records, 0.0, window_s, window_tokens, whole_s, whole_tokens)


async def server_info(url: str) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        async with s.get(f"{url}/server_info") as r:
            return await r.json()


async def wait_idle(url: str, timeout_s: float = 30.0) -> None:
    """Until the server has no request left running (cancelled ones retire on their next step), so
    the next block on another server does not share the host with this one's tail. A server that
    does not report its running count gets a short fixed pause."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        info = await server_info(url)
        if "running" not in info:
            await asyncio.sleep(0.5)
            return
        if not info["running"] and not info.get("waiting"):
            return
        await asyncio.sleep(0.05)


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
    """(accept length over the block, where it came from)."""
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


def step_figures(before: dict, after: dict) -> dict:
    """The server's own decode steps over a block, by side: count, mean batch and mean step time in ms.
    The reference engine times every step; the true-off plugin times the steps it can bracket on the
    device (not those that also carried a draft catch-up). NaN where the server reports no step times
    (SGLang without the plugin)."""

    def counts(info):
        return info.get("step_counters") or gate_counters(info).get("step_counters")

    a, b = counts(after), counts(before) or {}
    out = {}
    for side in ("plain", "spec"):
        if not a or side not in a:
            out |= {f"server_{side}_steps": None, f"server_{side}_batch": None, f"server_{side}_ms": None}
            continue
        steps, rows, _tokens, seconds = (x - y for x, y in zip(a[side], b.get(side, [0, 0, 0, 0.0]), strict=True))
        out[f"server_{side}_steps"] = steps
        out[f"server_{side}_batch"] = rows / steps if steps else None
        out[f"server_{side}_ms"] = 1000 * seconds / steps if steps else None
    return out


def _ms(values, q=None):
    if not values:
        return None
    arr = np.asarray(values) * 1000
    return float(np.mean(arr)) if q is None else float(np.percentile(arr, q))


def good_request(r: RequestRecord, slo: dict) -> bool:
    """A finished request within every limit the SLO sets (ttft_ms, tpot_ms, e2e_ms; None: no limit),
    as `sglang.bench_serving --goodput` counts one."""
    if r.error is not None or r.cancelled or r.e2e_s is None:
        return False
    tpot = (r.e2e_s - r.ttft_s) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
    limits = (("ttft_ms", r.ttft_s), ("tpot_ms", tpot), ("e2e_ms", r.e2e_s))
    return all(slo.get(k) is None or v * 1000 <= slo[k] for k, v in limits)


def summarize_block(block: Block, slo: dict | None = None) -> dict:
    """A block's figures, with the field names of `sglang.bench_serving` for the latencies."""
    records = block.records
    failed = [r for r in records if r.error is not None]
    done = [r for r in records if r.error is None and not r.cancelled]
    started = [r for r in records if r.error is None and r.ttft_s is not None]
    row = {"completed": len(done), "cancelled": sum(r.cancelled for r in records), "failed": len(failed),
           "error_rate": len(failed) / max(len(records), 1),
           "output_throughput": block.steady_throughput, "window_start_s": block.window_start_s,
           "window_s": block.window_s, "window_tokens": block.window_tokens,
           "whole_throughput": block.whole_throughput, "duration": block.whole_s,
           "total_output_tokens": block.whole_tokens, "request_throughput": len(done) / block.whole_s}  # fmt: skip
    ttft = [r.ttft_s for r in started]
    whole = [r for r in done if not r.staggered]  # a cut first request's E2E is not a request's
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in whole if r.output_tokens > 1]
    itl = [x for r in started for x in r.itl_s]
    e2e = [r.e2e_s for r in whole]
    for name, vals in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e_latency", e2e)):
        row[f"mean_{name}_ms"] = _ms(vals)
        row[f"median_{name}_ms"] = _ms(vals, 50)
        row[f"p99_{name}_ms"] = _ms(vals, 99)
    if slo is not None:
        row["goodput"] = sum(good_request(r, slo) for r in records) / block.whole_s
    row["errors"] = "; ".join(sorted({r.error for r in failed}))[:300]
    return row


def block_counters(before: dict, after: dict) -> dict:
    """What the server did between two reads of its counters (a closed-loop block's steady window, an
    open-loop block's whole span): accept length, the gate's counts, speculative counts, and its own
    step times."""
    row = {}
    row["accept_length"], row["accept_length_source"] = accept_length(before, after)
    gate, gate_before = gate_counters(after), gate_counters(before)
    row["auto_threshold"] = settled_threshold(gate)
    # the block's own counts; probes are the auto gate's, flushes SGLang's true-off buffers'
    for key in ("steps_on", "steps_off", "switches", "probes", "flushes"):
        row[f"gate_{key}"] = gate[key] - gate_before.get(key, 0) if key in gate else None
    counts, counts_before = spec_counts(after), spec_counts(before) or {}
    for key in ("verify", "accepted", "verify_resumed", "accepted_resumed"):  # this block's, for the report
        row[f"spec_{key}"] = counts[key] - counts_before.get(key, 0) if counts else None
    return row | step_figures(before, after)


@dataclass
class Load:
    """One load level: closed loop at `concurrency`, or open loop at `rate` requests per second."""

    concurrency: int | None = None
    rate: float | None = None

    @property
    def name(self) -> str:
        return f"c={self.concurrency}" if self.rate is None else f"rate={self.rate:g}"


async def measure_block(url: str, model: str, prompts, lengths, load: Load, *, variant: str, warmup_s: float,
                        window_s: float, start: int, seed: int, ignore_eos: bool, timeout_s: float,
                        slo: dict | None, stagger: bool = False) -> tuple[dict, list[dict]]:  # fmt: skip
    """One block on one server: (its summary row with the server's counters, its request records)."""
    before = await server_info(url)
    if load.rate is None:
        block = await closed_block(url, model, prompts, lengths, load.concurrency, warmup_s=warmup_s,
                                   window_s=window_s, start=start, ignore_eos=ignore_eos, variant=variant,
                                   timeout_s=timeout_s, stagger=stagger)  # fmt: skip
    else:
        block = await open_block(url, model, prompts, lengths, load.rate, window_s=window_s, seed=seed, start=start,
                                 ignore_eos=ignore_eos, variant=variant, timeout_s=timeout_s)  # fmt: skip
    await wait_idle(url)
    after = await server_info(url)
    if block.info_at_start is not None:  # closed loop: the server's figures over the steady window
        before, after = block.info_at_start, block.info_at_end
    return summarize_block(block, slo) | block_counters(before, after), [r.to_dict() for r in block.records]


BASELINE_COLUMNS = ("output_throughput", "whole_throughput", "window_s", "window_tokens", "median_itl_ms",
                    "p99_itl_ms", "median_ttft_ms", "p99_ttft_ms", "goodput", "server_plain_steps",
                    "server_plain_batch", "server_plain_ms", "failed")  # fmt: skip


@dataclass
class Entry:
    """One thing the sweep measures: a variant on a server, with the gate to switch that server to
    first (`gate` and `control`: a server whose gate is switched at run time) or not."""

    name: str
    url: str
    gate: dict | None = None  # settings for specgate.gate_control, or None: the server as started
    control: str | None = None  # that server's control file
    baseline: bool = False  # the no-spec figures every ratio divides by
    emit: bool = True  # a row of its own (False: a paired job's baseline server, seen only in baseline_*)
    prime: int = 0  # concurrency of an unmeasured block before the levels (a gate crosses its threshold once)


class Switcher:
    """Switches servers' gates through their control files and waits until each has switched."""

    def __init__(self):
        self.generation = 0

    async def switch(self, entry: Entry, model: str, prompts, timeout_s: float = 60.0) -> None:
        from specgate.gate_control import write_control

        self.generation += 1
        write_control(entry.control, self.generation, entry.gate)
        deadline = time.perf_counter() + timeout_s
        poked = time.perf_counter() + 0.3
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            while time.perf_counter() < deadline:
                if gate_counters(await server_info(entry.url)).get("control_generation") == self.generation:
                    return
                if time.perf_counter() > poked:  # an idle SGLang scheduler reads the file on its next decode step
                    rec = RequestRecord(entry.name, 1, 0)
                    await one_request(session, entry.url, model, prompts[0], 2, True, rec, time.perf_counter())
                    poked = time.perf_counter() + 0.3
                await asyncio.sleep(0.02)
        raise LevelFailed(f"{entry.name}: the server at {entry.url} did not switch its gate within {timeout_s:.0f} s "
                          f"(control file {entry.control})")  # fmt: skip


def turn_order(entries: list[Entry], turn: int, order: str) -> list[Entry]:
    """The blocks of one turn. "rotate": every entry once, the order rotating by one each turn, so no
    entry always follows another. "sandwich": the entries other than the baseline, rotated the same
    way, each between two baseline blocks (B v1 B v2 B ... vk B): a host whose speed drifts over
    seconds (a shared VM's did by ±15% within a minute) then moves a block and the baseline beside it
    alike, at the cost of k + 1 baseline blocks a turn instead of one."""
    if order == "rotate":
        k = turn % len(entries)
        return entries[k:] + entries[:k]
    base = [e for e in entries if e.baseline]
    others = [e for e in entries if not e.baseline]
    if not base or not others:
        return turn_order(entries, turn, "rotate")
    k = turn % len(others)
    sequence = [base[0]]
    for entry in others[k:] + others[:k]:
        sequence += [entry, base[0]]
    return sequence


def baseline_beside(measured: list[tuple[Entry, dict, list]], position: int) -> dict | None:
    """The baseline figures a block is divided by: the mean of the baseline blocks right before and after
    it (sandwich), else the turn's one baseline block (rotate), else its own (the baseline itself)."""
    entry = measured[position][0]
    if entry.baseline:
        return measured[position][1]
    near = [m[1] for m in (measured[position - 1] if position else None,
                           measured[position + 1] if position + 1 < len(measured) else None)
            if m is not None and m[0].baseline]  # fmt: skip
    if not near:
        near = [m[1] for m in measured if m[0].baseline][:1]
    if not near:
        return None
    return {k: (None if any(n.get(k) is None for n in near) else sum(n[k] for n in near) / len(near))
            for k in BASELINE_COLUMNS}


async def sweep_blocks(entries: list[Entry], model: str, prompts, lengths, loads: list[Load], *, blocks: int,
                       warmup_s: float, window_s: float, rate_window_s: float, ignore_eos: bool,
                       max_error_rate: float, seed: int = 0, timeout_s: float = 600, slo: dict | None = None,
                       order: str = "sandwich", stagger: bool = False, progress=None):  # fmt: skip
    """Every load level against every entry, in turns: (records, rows).

    At each level the entries take `blocks` turns, each on the same requests in the same order
    (`turn_order`). Each row is one entry's block, with the baseline's figures beside it
    (`baseline_*`, `baseline_beside`) and their ratio: figures measured seconds apart, so drift of
    the host cancels in the ratio.

    A block whose error rate exceeds `max_error_rate` raises LevelFailed after its records are kept.
    An entry with `prime` gets one unmeasured block at that concurrency first: a gated server that
    crosses its threshold once before measuring pays one-time costs of that path outside the levels
    (on an H200 the first off step of an SGLang true-off server stalled for 10.4 s). Each closed-loop
    level starts with one unmeasured block on each server, the speculative one always on where that
    entry exists, so the batch sizes new at that level are met before any block is measured.
    """
    switcher = Switcher()
    current = {}  # url -> the entry whose gate that server runs now

    async def use(entry: Entry):
        if entry.gate is not None and current.get(entry.url) is not entry:
            await switcher.switch(entry, model, prompts)
            await wait_idle(entry.url)
        current[entry.url] = entry

    for entry in entries:
        if entry.prime:
            await use(entry)
            await closed_block(entry.url, model, prompts, lengths, entry.prime, warmup_s=0.0, window_s=warmup_s,
                               ignore_eos=ignore_eos, variant=entry.name, timeout_s=timeout_s)  # fmt: skip
            await wait_idle(entry.url)
    baseline = next((e for e in entries if e.baseline), None)
    all_records, rows = [], []
    start = 0
    for load in loads:
        seconds = window_s if load.rate is None else rate_window_s
        level_rows = []
        if load.rate is None:
            # one unmeasured block per server at the level first: a speculative server's first block at a new
            # concurrency pays one-time costs of the batch sizes it meets (on an H100, the always-on block that
            # came first read 0.55-0.95 of no-spec where the two after it read 0.75-1.56), and a measured block
            # must not carry them
            warm = {}  # url -> the entry that warms it: always-on on the speculative server, where swept
            for e in entries:
                if e.url not in warm or e.name == "always":
                    warm[e.url] = e
            for entry in warm.values():
                log.info("unmeasured block: %s at %s", entry.name, load.name)
                await use(entry)
                await closed_block(entry.url, model, prompts, lengths, load.concurrency, warmup_s=warmup_s,
                                   window_s=seconds, ignore_eos=ignore_eos, variant=entry.name, timeout_s=timeout_s,
                                   stagger=stagger)  # fmt: skip
                await wait_idle(entry.url)
        for b in range(blocks):
            sequence = turn_order(entries, b, order)
            measured, used = [], 0
            for entry in sequence:
                await use(entry)
                row, records = await measure_block(
                    entry.url, model, prompts, lengths, load, variant=entry.name, warmup_s=warmup_s,
                    window_s=seconds, start=start, seed=seed * 100_003 + start, ignore_eos=ignore_eos,
                    timeout_s=timeout_s, slo=slo, stagger=stagger)  # fmt: skip
                measured.append((entry, row, records))
                used = max(used, len(records))
                failed = row["failed"]
                total = row["completed"] + row["cancelled"] + failed
                if failed / max(total, 1) > max_error_rate:
                    raise LevelFailed(f"{entry.name} at {load.name}: {failed} of {total} requests failed (error rate "
                                      f"above bench.max_error_rate {max_error_rate}): {row['errors']}")  # fmt: skip
            emitted_baseline = False
            for position, (entry, row, records) in enumerate(measured):
                if not entry.emit or (entry.baseline and emitted_baseline):
                    continue  # a paired job's own no-spec server; the sandwich's later no-spec blocks
                emitted_baseline |= entry.baseline
                row = {"variant": entry.name, "concurrency": load.concurrency, "request_rate": load.rate, "block": b,
                       "position": position, **row}  # fmt: skip
                base = baseline_beside(measured, position) if baseline is not None else None
                if base is not None:
                    row |= {f"baseline_{k}": base.get(k) for k in BASELINE_COLUMNS}
                    row["ratio"] = _ratio(row["output_throughput"], base["output_throughput"])
                    row["whole_ratio"] = _ratio(row["whole_throughput"], base["whole_throughput"])
                    if load.rate is not None and base.get("goodput"):
                        row["goodput_ratio"] = row["goodput"] / base["goodput"]
                all_records += [{**r, "block": b, "request_rate": load.rate} for r in records]
                level_rows.append(row)
            start += max(used, 1)  # the next block starts further down the request list: fresh requests
        rows += level_rows
        if progress:
            progress(load, level_rows)
    return all_records, rows


def _ratio(x: float, base: float) -> float:
    """x / base; NaN where the baseline's window held no tokens (nothing to compare against)."""
    return x / base if base > 0 else float("nan")


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
