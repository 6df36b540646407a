"""The auto gate against a cost model, in the sweep's closed loop, without an engine.

A model check, not a measurement: every decode step costs what the cost model says (fixed + per-request
x batch, times a uniform noise), a speculative step gives each request 1 + accepted drafts tokens
(accepted in a chain with the probability that makes the mean tau), and each admission of new requests
costs one prefill. The levels run as the sweep runs them: c = 1, 2, 4, ... in order on one gate, each
with max(min_requests, requests_per_concurrency x c) requests of max_tokens, after a warm-up level.
It prints each variant's envelope efficiency and the auto gate's ratio to the best fixed threshold,
over several seeds. Use it to see what the policy's warm-up, dwell and probes cost at a deployment's
step costs and level lengths before spending GPU time.

    python benchmarks/auto_gate_model.py            # the 8B-cost H200 deployment's fit (h200-8bcost.md)
    python benchmarks/auto_gate_model.py --plain 22 9.5 --spec 26 13.6 --tau 1.37 --thresholds 2 4 8
    python benchmarks/auto_gate_model.py --admit-delay 2 --catchup-ms 2 0.5   # dips below c, and catch-ups
    python benchmarks/auto_gate_model.py --first-use-stall-ms 150   # each batch size's first speculative step stalls
    python benchmarks/auto_gate_model.py --plain 6.2 0.025 --spec 8.1 0.24 --knee 16 4 --tau 1.78   # flat, then growing

Gated variants first get the sweep's unmeasured priming wave (--prime, max_running requests at once).
"""

from __future__ import annotations

import argparse
import random
import statistics
from pathlib import Path

from specgate.gate import AutoConfig, AutoGate, Gate, GateConfig


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plain", type=float, nargs=2, default=(4.75, 0.070), metavar=("FIXED_MS", "PER_REQUEST_MS"))
    p.add_argument("--spec", type=float, nargs=2, default=(7.07, 0.407), metavar=("FIXED_MS", "PER_REQUEST_MS"))
    p.add_argument("--knee", type=int, nargs=2, default=(0, 0), metavar=("PLAIN", "SPEC"),
                   help="the batch below which each side's step costs only its fixed part, as on a GPU the batch does "
                        "not yet fill: a step costs fixed + per-request x max(batch - knee, 0)")
    p.add_argument("--tau", type=float, default=1.83, help="tokens per request per speculative step")
    p.add_argument("--num-steps", type=int, default=3, help="draft tokens per speculative step")
    p.add_argument("--prefill-ms", type=float, default=8.0, help="cost of one admission of new requests")
    p.add_argument("--noise", type=float, default=0.03, help="step times vary uniformly by this share")
    p.add_argument("--admit-delay", type=int, default=0,
                   help="decode steps between a request's finish and its successor joining the batch (the client's "
                        "round trip and the prefill's scheduling): the batch dips below c for that long")
    p.add_argument("--catchup-ms", type=float, nargs=2, default=(0.0, 0.0), metavar=("FIXED_MS", "PER_REQUEST_MS"),
                   help="what a speculative step right after a plain one costs more (the draft's catch-up)")
    p.add_argument("--first-use-stall-ms", type=float, default=0.0,
                   help="what the first speculative step at each batch size costs more (a kernel's first compile)")
    p.add_argument("--prime", type=int, default=128,
                   help="the sweep's unmeasured first wave for the auto gate: this many requests at once (max_running)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    p.add_argument("--thresholds", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--min-requests", type=int, default=16)
    p.add_argument("--requests-per-concurrency", type=int, default=2)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--out", help="also write the table to this markdown file")
    return p.parse_args(argv)


def chain_probability(tau: float, k: int) -> float:
    """q such that 1 + q + q^2 + ... + q^k = tau: each draft accepted while the ones before it were."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        q = (lo + hi) / 2
        lo, hi = (q, hi) if sum(q**i for i in range(k + 1)) < tau else (lo, q)
    return (lo + hi) / 2


def level(gate, c: int, a: argparse.Namespace, q: float, rng: random.Random, compiled: set | None = None) -> float:
    """One closed-loop level; output tokens per second. `compiled`: the batch sizes a speculative step has
    already run at on this server (each one's first pays --first-use-stall-ms)."""
    total, sent, active, seconds, tokens = max(a.min_requests, a.requests_per_concurrency * c), 0, [], 0.0, 0
    waiting, last_spec = [], True  # steps until each finished request's successor may join
    compiled = set() if compiled is None else compiled
    while True:
        admitted = 0
        free = c - len(active) - len(waiting)  # slots whose successor is not on its way
        # a free slot takes a new request only while some are left beyond the successors on their way
        while (free > 0 and sent + len(waiting) < total or waiting and min(waiting) <= 0) and sent < total:
            if waiting and min(waiting) <= 0:
                waiting.remove(min(waiting))
            else:
                free -= 1
            active.append(a.max_tokens)
            sent, admitted = sent + 1, admitted + 1
        seconds += a.prefill_ms / 1000 if admitted else 0.0
        if not active and waiting:  # every successor on its way: the server idles for a step's time
            seconds += a.plain[0] / 1000
            waiting = [w - 1 for w in waiting]
            continue
        if not active:
            return tokens / seconds
        b = len(active)
        spec = gate.decide(b) if gate else False
        (fixed, per), knee = (a.spec, a.knee[1]) if spec else (a.plain, a.knee[0])
        step = (fixed + per * max(b - knee, 0)) / 1000 * rng.uniform(1 - a.noise, 1 + a.noise)
        catchup = (a.catchup_ms[0] + a.catchup_ms[1] * b) / 1000 if spec and not last_spec else 0.0
        if spec and b not in compiled:
            compiled.add(b)
            step += a.first_use_stall_ms / 1000
        last_spec = spec
        made = 0
        for i in range(b):
            n = 1
            while spec and n <= a.num_steps and rng.random() < q:
                n += 1
            n = min(n, active[i])
            active[i] -= n
            made += n
        seconds, tokens = seconds + step + catchup, tokens + made
        if gate:
            gate.observe_time(b, spec, step + catchup)
            if spec:
                gate.observe_tokens(b, made)
        finished = sum(r == 0 for r in active)
        active = [r for r in active if r > 0]
        successors = min(finished, total - sent - len(waiting))  # the last requests of a level have none
        waiting = [w - 1 for w in waiting] + [a.admit_delay] * successors


def sweep(make, a, q, seed) -> dict[int, float]:
    rng, gate, compiled = random.Random(seed), make(), set()
    if gate:
        if a.prime:  # the sweep primes a gated server with one unmeasured wave (bench.py: max_running for auto)
            wave = argparse.Namespace(**{**vars(a), "min_requests": a.prime, "requests_per_concurrency": 1})
            level(gate, a.prime, wave, q, rng, compiled)
        level(gate, 4, a, q, rng, compiled)  # the sweep's warm-up requests
    return {c: level(gate, c, a, q, rng, compiled) for c in a.concurrency}


def main(argv=None) -> int:
    a = parse_args(argv)
    q = chain_probability(a.tau, a.num_steps)
    variants = {"nospec": lambda: None, "always": lambda: Gate(GateConfig(None)), "auto": lambda: AutoGate(AutoConfig())}
    variants |= {f"gate_{t}": (lambda t=t: Gate(GateConfig(t))) for t in a.thresholds}
    envelopes = {v: [] for v in variants}
    ratios = []
    for seed in range(a.seeds):
        tps = {v: sweep(make, a, q, seed) for v, make in variants.items()}
        env = {v: min(tps[v][c] / max(tps["nospec"][c], tps["always"][c]) for c in a.concurrency) for v in tps}
        for v in env:
            envelopes[v].append(env[v])
        ratios.append(env["auto"] / max(env[f"gate_{t}"] for t in a.thresholds))
    knees = f" beyond batch {a.knee[0]} / {a.knee[1]}" if any(a.knee) else ""
    lines = [f"plain {a.plain[0]} + {a.plain[1]} ms/request, speculative {a.spec[0]} + {a.spec[1]} ms/request{knees}, "
             f"tau {a.tau}, {a.seeds} seeds", "", "| variant | envelope efficiency, median (min-max) |", "|---|---|"]
    lines += [f"| {v} | {statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f}) |" for v, xs in envelopes.items()]
    lines += ["", f"auto / best fixed threshold: {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"]
    print("\n".join(lines))
    if a.out:
        Path(a.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
