#!/usr/bin/env python3
"""The auto gate after a workload shift, against fixed thresholds, on the reference engine or SGLang.

Each variant's server (auto, gate_T for each --thresholds, no-spec and always-on) gets the same
traffic: a closed loop at --concurrency, first --seconds of prompts from one eval source (e.g.
HumanEval, higher acceptance), then --seconds from another (e.g. ShareGPT). Output tokens are
counted per --window seconds by the time they stream; every server's gate counters are read every
window.

Reported:
  per variant, the steady throughput of each phase (median of the windows in its second half);
  the better fixed threshold for the new traffic, and how long after the shift the auto gate's
  rolling throughput (two windows) stays within 5% of it;
  how long after the shift the auto gate speculates on the same share of decode steps as that fixed
  gate: servers of one engine run one after another, so their throughputs also differ by how fast the
  machine was meanwhile, while their decisions do not;
  the auto gate's threshold and tau per window, and its probes.

Needs the workflow's artifacts (a target and an exported drafter) and the eval set:
  python benchmarks/auto_shift.py --target results/target --drafter results/drafter \
      --eval results/data/eval.jsonl --from-source humaneval --to-source sharegpt --out auto_shift.md
On a GPU host with SGLang, through specgate's true-off plugin, with the pair the workflow serves
(results/target_widened and results/drafter_widened under target.widen):
  python benchmarks/auto_shift.py --engine sglang --target results/target_widened \
      --drafter results/drafter_widened --eval results/data/eval.jsonl --concurrency 8 \
      --thresholds 4,8,16 --max-running 128 --attention-backend triton \
      --extra-args="--sampling-backend pytorch --grammar-backend none --mem-fraction-static 0.6 --cuda-graph-max-bs-decode 16"
(--grammar-backend none where xgrammar is not installed; --no-references leaves out no-spec and always-on,
which cost two phases each.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np

from specgate.sweep.bench import served_model
from specgate.sweep.launcher import ServeSettings, Variant, reference_command, sglang_command
from specgate.sweep.load_client import RequestRecord, bench_prompts, gate_counters, one_request, server_info
from specgate.sweep.managed_server import ManagedServer, free_port



def spread_length(max_tokens: int, spread: float, i: int) -> int:
    """Request i's output length: max_tokens x (1 - spread/2 + spread x u_i), u_i uniform, the same for every
    variant. With one length for all, plain steps keep a closed loop's requests in step and their successors
    share one prefill, while speculation staggers them into a prefill each."""
    if spread <= 0:
        return max_tokens
    return max(1, round(max_tokens * (1 - spread / 2 + spread * random.Random(i).random())))

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--eval", required=True, help="eval JSONL with a 'source' per record (results/data/eval.jsonl)")
    p.add_argument("--from-source", default="humaneval")
    p.add_argument("--to-source", default="sharegpt")
    p.add_argument("--thresholds", default="2,4,8")
    p.add_argument("--no-references", action="store_true",
                   help="serve only auto and the fixed thresholds, not no-spec and always-on (each server costs 2 x --seconds)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seconds", type=float, default=60, help="length of each phase")
    p.add_argument("--window", type=float, default=5)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--length-spread", type=float, default=0.5,
                   help="request i gets max_tokens x (1 - spread/2 + spread x u_i), u_i uniform and the same for every "
                        "variant: with one length for all, plain steps keep a closed loop's requests in step, so their "
                        "successors share one prefill, while speculation staggers them into one prefill each")
    p.add_argument("--num-steps", type=int, default=3)
    p.add_argument("--max-running", type=int, default=8)
    p.add_argument("--engine", choices=["reference", "sglang"], default="reference")
    p.add_argument("--device", default="cpu", help="reference engine")
    p.add_argument("--attention-backend", help="SGLang")
    p.add_argument("--extra-args", default="", help='more SGLang server flags, e.g. --extra-args="--sampling-backend pytorch"')
    p.add_argument("--ready-timeout", type=float, default=900)
    p.add_argument("--work-dir", default="results/auto_shift")
    p.add_argument("--out", help="also write the page here")
    return p.parse_args(argv)


def shift_variants(a) -> list[Variant]:
    """auto, gate_T for each threshold, then no-spec and always-on unless --no-references."""
    variants = [Variant("auto", True, auto=True)]
    variants += [Variant(f"gate_{t}", True, int(t)) for t in a.thresholds.split(",")]
    if not a.no_references:
        variants += [Variant("nospec", False), Variant("always", True)]
    return variants


def server_command(a, v: Variant, port: int, work: Path) -> tuple[list[str], dict]:
    """The variant's server: the reference engine, or SGLang with specgate's gate plugin alone."""
    settings = ServeSettings(target=a.target, draft=a.drafter, num_steps=a.num_steps, max_running=a.max_running,
                             device=a.device, attention_backend=a.attention_backend,
                             extra_args=shlex.split(a.extra_args))  # fmt: skip
    if a.engine == "sglang":
        settings.env = {"SGLANG_PLUGINS": "specgate_gate"}
        return sglang_command(settings, v, port, work)
    return reference_command(settings, v, port)


async def phase(url, model, prompts, a, t_run, records, stop_at):
    """Closed loop until `stop_at` (seconds since t_run); completions are timed from t_run."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:

        async def worker(w):
            i = w
            while time.perf_counter() - t_run < stop_at:
                rec = RequestRecord("", a.concurrency, i)
                await one_request(s, url, model, prompts[i % len(prompts)], spread_length(a.max_tokens, a.length_spread, i), True,
                                  rec, t_run)  # fmt: skip
                records.append(rec)
                i += a.concurrency

        await asyncio.gather(*(worker(w) for w in range(a.concurrency)))


async def watch(url, a, t_run, out, done):
    while not done.is_set():
        info = await server_info(url)
        gate = gate_counters(info)
        out.append({"t": round(time.perf_counter() - t_run, 1), "threshold": gate.get("auto_threshold"),
                    "tau": gate.get("tau"), "probes": gate.get("probes"), "gate_on": gate.get("gate_on"),
                    "steps_on": gate.get("steps_on") or 0, "steps_off": gate.get("steps_off") or 0,
                    "steps": (gate.get("steps_on") or 0) + (gate.get("steps_off") or 0)})  # fmt: skip
        try:
            await asyncio.wait_for(done.wait(), a.window)
        except asyncio.TimeoutError:
            pass


async def drive(url, model, a, before, after):
    t_run, records, gate_log, done = time.perf_counter(), [], [], asyncio.Event()
    watcher = asyncio.create_task(watch(url, a, t_run, gate_log, done))
    await phase(url, model, before, a, t_run, records, a.seconds)
    shift = time.perf_counter() - t_run  # the last requests of phase one have drained
    await phase(url, model, after, a, t_run, records, shift + a.seconds)
    done.set()
    await watcher
    return records, shift, gate_log


def windows(records, start, end, width):
    """Output tokens per second in consecutive windows of [start, end), by the time each token streamed.

    Binning whole requests by completion time quantizes a window to whole requests: at ~40 tok/s and
    48 tokens per request a 5 s window holds about 4, a step of 25%. A request's tokens are spread
    evenly over its streamed chunks (a speculative step may send several tokens in one chunk)."""
    n = int((end - start) // width)
    tokens = [0.0] * n
    for r in records:
        if r.error is not None or r.ttft_s is None:
            continue
        times = r.start_s + r.ttft_s + np.concatenate([[0.0], np.cumsum(r.itl_s)])
        for t in times:
            k = int((t - start) // width)
            if 0 <= k < n:
                tokens[k] += r.output_tokens / len(times)
    return [t / width for t in tokens]


def decisions_settle(auto_log, fixed_log, shift, tolerance=0.05, probe_len=2):
    """Seconds after the shift by which the auto gate decides as the fixed gate does, for good.

    Per interval between two polls of the gate counters (one per window), the share of decode steps that
    speculated by decision, probes left out (they are the price of following a shift, counted apart).
    Two servers of one engine that speculate on the same share of steps do the same work per step, so
    their throughput differs only by what the machine does meanwhile. On a shared 2-vCPU VM that
    drifts by ±10% over minutes, which is more than the 5% being resolved when servers run one after another.
    Returns the end of the first interval after the shift from which every interval's share is within
    `tolerance` of the fixed gate's in the interval at the same offset from the shift; None if none."""

    def shares(log):
        out = []
        for a, b in zip(log, log[1:]):
            if a["t"] < shift:
                continue
            probe_steps = probe_len * ((b.get("probes") or 0) - (a.get("probes") or 0))
            decided_on = max(b["steps_on"] - a["steps_on"] - probe_steps, 0)
            out.append((b["t"] - shift, decided_on / max(b["steps"] - a["steps"], 1)))
        return out

    auto, fixed = shares(auto_log), shares(fixed_log)
    n = min(len(auto), len(fixed))
    close = [abs(auto[i][1] - fixed[i][1]) <= tolerance for i in range(n)]
    first = next((i for i in range(n) if all(close[i:])), None)
    return (auto[first][0] if first is not None else None), auto[:n], fixed[:n]


def main(argv=None) -> int:
    a = parse_args(argv)
    evals = [json.loads(line) for line in Path(a.eval).read_text().splitlines() if line.strip()]
    by_source = {src: bench_prompts([r for r in evals if r.get("source") == src], 64, seed=0)
                 for src in (a.from_source, a.to_source)}  # fmt: skip
    thresholds = [int(t) for t in a.thresholds.split(",")]
    variants = shift_variants(a)
    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    result = {}
    for v in variants:
        port = free_port()
        cmd, env = server_command(a, v, port, work)
        print(f"[{time.strftime('%H:%M:%S')}] {v.name}", flush=True)
        with ManagedServer(cmd, port, work / f"{v.name}.log", ready_timeout=a.ready_timeout, env=env) as server:
            records, shift, gate_log = asyncio.run(drive(server.url, served_model(server.url), a, by_source[a.from_source],
                                                         by_source[a.to_source]))  # fmt: skip
        one, two = windows(records, 0, shift, a.window), windows(records, shift, shift + a.seconds, a.window)
        result[v.name] = {"one": one, "two": two, "shift": shift, "gate": gate_log,
                          "steady_one": statistics.median(one[len(one) // 2:]),
                          "steady_two": statistics.median(two[len(two) // 2:])}  # fmt: skip
        print(f"  phase 1 {result[v.name]['steady_one']:.1f} tok/s, phase 2 {result[v.name]['steady_two']:.1f} tok/s")

    fixed = [f"gate_{t}" for t in thresholds]
    best_one = max(fixed, key=lambda g: result[g]["steady_one"])
    best_two = max(fixed, key=lambda g: result[g]["steady_two"])
    target = 0.95 * result[best_two]["steady_two"]
    two = result["auto"]["two"]
    rolling = [(two[i] + two[i + 1]) / 2 for i in range(len(two) - 1)]
    settle = next((i for i in range(len(rolling)) if all(x >= target for x in rolling[i:])), None)
    decided, auto_shares, best_shares = decisions_settle(result["auto"]["gate"], result[best_two]["gate"],
                                                         result["auto"]["shift"])  # fmt: skip
    last = result["auto"]["gate"][-1]
    probe_steps = 2 * (last["probes"] or 0)  # probe_len 2, the default
    lines = [f"`{shlex.join(['python', 'benchmarks/auto_shift.py', *sys.argv[1:]])}`", "",
             f"Closed loop at concurrency {a.concurrency}, {a.max_tokens} output tokens per request on average "
             f"(spread {a.length_spread:g}), greedy; "
             f"{a.seconds:g} s of `{a.from_source}` prompts, then {a.seconds:g} s of `{a.to_source}`; windows of "
             f"{a.window:g} s; steady = median of a phase's second-half windows. One run.", "",
             f"| variant | steady tok/s, {a.from_source} | steady tok/s, {a.to_source} |", "|---|---|---|"]  # fmt: skip
    lines += [f"| {v} | {r['steady_one']:.1f} | {r['steady_two']:.1f} |" for v, r in result.items()]
    lines += ["", f"Best fixed threshold: {best_one} before the shift, {best_two} after it.",
              f"auto ÷ {best_one} before: {result['auto']['steady_one'] / result[best_one]['steady_one']:.3f}; "
              f"auto ÷ {best_two} after: {result['auto']['steady_two'] / result[best_two]['steady_two']:.3f}.",
              "Within 5% of " + best_two + " for good (two-window rolling mean) from "
              + (f"{(settle + 2) * a.window:g} s after the shift." if settle is not None else "no point in the run."),
              f"Decides as {best_two} does (share of decode steps speculated by decision, probes apart, within 0.05 of {best_two}'s in every "
              "later window) from " + (f"{decided:.1f} s after the shift." if decided is not None else "no point in the run.")
              + " Per window after the shift, auto / " + best_two + ": "
              + ", ".join(f"{x:.2f}/{y:.2f}" for (_, x), (_, y) in zip(auto_shares, best_shares)) + ".",
              f"Probe steps: {probe_steps} of {last['steps']} decode steps ({probe_steps / max(last['steps'], 1):.2%}); "
              "each costs at most the difference between the two sides' step throughput at that batch.",
              "", "Auto gate per window (seconds from the start; the shift at "
              f"{result['auto']['shift']:.1f} s):", "",
              "| t | threshold | tau | probes | on |", "|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {g['t']} | {g['threshold'] if g['threshold'] is not None else 'none'} | {g['tau']} | {g['probes']} | "
              f"{g['gate_on']} |" for g in result["auto"]["gate"]]  # fmt: skip
    if a.out:
        Path(a.out).write_text("\n".join(lines) + "\n")
    (work / "auto_shift.json").write_text(json.dumps(result, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
