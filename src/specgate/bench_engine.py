"""Benchmark: the reference engine without speculation, always on, and gated, side by side.

Closed loop in one process: for each variant an Engine is built, and at each concurrency c
exactly c requests are in flight (a finished one is replaced at once) until `requests`
have completed. Greedy outputs of every speculative variant are compared with no-spec.
"""

from __future__ import annotations

import threading
import time

from specgate.chat import prompt_ids
from specgate.engine import Engine, EngineConfig
from specgate.files import atomic_path, read_jsonl
from specgate.gate import GateConfig
from specgate.provenance import cpu_model


def closed_loop(engine: Engine, prompts: list[list[int]], concurrency: int, requests: int, max_new: int):
    outputs: dict[int, list[int]] = {}
    lock, done = threading.Lock(), threading.Event()
    state = {"next": 0, "finished": 0}

    def launch():
        i = state["next"]
        state["next"] += 1
        out: list[int] = []
        outputs[i] = out

        def on_done(reason, error):
            with lock:
                state["finished"] += 1
                if state["next"] < requests:
                    launch()
                if state["finished"] == requests:
                    done.set()

        engine.submit(prompts[i % len(prompts)], max_new, True, out.extend, on_done)

    t0 = time.perf_counter()
    with lock:
        for _ in range(min(concurrency, requests)):
            launch()
    done.wait()
    elapsed = time.perf_counter() - t0
    return sum(len(o) for o in outputs.values()) / elapsed, outputs


def fp32_lossless_check(target: str, draft: str, eval_jsonl: str, *, num_steps: int = 3, concurrency: int = 4,
                        requests: int = 12, max_new: int = 48, gates=(None, 2, 3)) -> dict:  # fmt: skip
    """Greedy outputs of no-spec, always-on and gated engines in fp32, where rounding cannot flip an argmax."""
    outs, switches = {}, {}
    for name, d, gate in [("nospec", None, None)] + [(f"spec_{g}", draft, g) for g in gates]:
        engine = Engine(EngineConfig(target, d, num_steps, GateConfig(gate), max_running=concurrency, max_len=1024,
                                     dtype="float32"))  # fmt: skip
        prompts = [prompt_ids(engine.tokenizer, r["messages"][:1]) for r in read_jsonl(eval_jsonl)]
        prompts = [p for p in prompts if len(p) < 600][:requests]
        outs[name] = closed_loop(engine, prompts, concurrency, requests, max_new)[1]
        switches[name] = engine.gate.counters()["switches"]
        engine.shutdown()
    identical = all(o == outs["nospec"] for o in outs.values())
    return {"identical": identical, "requests": requests, "max_new": max_new, "concurrency": concurrency,
            "gates": ["always" if g is None else g for g in gates], "switches": sum(switches.values())}  # fmt: skip


def run_engine_benchmark(target: str, draft: str, eval_jsonl: str, *, concurrencies=(1, 4, 16), threshold: int = 4,
                         num_steps: int = 3, max_new: int = 64, requests_per_level: int = 16, out: str | None = None) -> str:  # fmt: skip
    variants = {"nospec": (None, GateConfig(None)), "always": (draft, GateConfig(None)),
                f"gate_{threshold}": (draft, GateConfig(threshold))}  # fmt: skip
    rows, outputs, accept = {}, {}, {}
    for name, (d, gate) in variants.items():
        engine = Engine(EngineConfig(target, d, num_steps, gate, max_running=max(concurrencies), max_len=1024))
        prompts = [prompt_ids(engine.tokenizer, r["messages"][:1]) for r in read_jsonl(eval_jsonl)]
        prompts = [p for p in prompts if len(p) < 600][:32]
        closed_loop(engine, prompts, 1, 2, 8)  # warm-up
        for c in concurrencies:
            tps, outs = closed_loop(engine, prompts, c, max(requests_per_level, c), max_new)
            rows[(name, c)] = tps
            outputs[(name, c)] = outs
        accept[name] = engine.stats()["avg_spec_accept_length"]
        engine.shutdown()
    lossless = all(outputs[(n, c)] == outputs[("nospec", c)] for n in variants for c in concurrencies)
    exact = fp32_lossless_check(target, draft, eval_jsonl, num_steps=num_steps)
    lines = ["# Reference engine: no speculation vs EAGLE-3 always on vs gated", "",
             f"Machine: {cpu_model()}; target `{target}`, drafter `{draft}`, {num_steps} draft steps, greedy, "
             f"{max_new} new tokens per request (ignore_eos), closed loop, {requests_per_level} requests per level.",
             "Command: `python -c \"from specgate.bench_engine import run_engine_benchmark; "
             "run_engine_benchmark('results/target', 'results/drafter', 'results/data/eval.jsonl', out='docs/benchmarks/engine.md')\"`", "",
             "| concurrency | " + " | ".join(f"{n} tok/s" for n in variants) + " | always ÷ nospec | gated ÷ nospec |",
             "|---|" + "---|" * (len(variants) + 2)]  # fmt: skip
    for c in concurrencies:
        vals = [rows[(n, c)] for n in variants]
        lines.append(f"| {c} | " + " | ".join(f"{v:.1f}" for v in vals) + f" | {vals[1] / vals[0]:.2f} | {vals[2] / vals[0]:.2f} |")
    lines += ["", f"Accept length (server counter): always {accept['always']}, gated {accept[f'gate_{threshold}']}.",
              f"bf16 (as benchmarked): greedy outputs of every variant identical to no-spec at every level: {lossless}.",
              f"fp32 lossless check ({exact['requests']} requests x {exact['max_new']} tokens at concurrency "
              f"{exact['concurrency']}, gates {exact['gates']}): every variant identical to no-spec token for token: "
              f"{exact['identical']}; gated runs switched {exact['switches']} times.", ""]  # fmt: skip
    text = "\n".join(lines)
    if out:
        with atomic_path(out) as tmp:
            tmp.write_text(text)
    return text
