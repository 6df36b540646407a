"""The reference engine without speculation, with EAGLE-3 always on, and gated, side by side.

    python benchmarks/reference_engine.py --out docs/benchmarks/engine.md
    python benchmarks/reference_engine.py --concurrency 1 2 4 8 --threshold 3 --repeats 3 --out engine.md

Needs the workflow's outputs: a materialised target (results/target), an exported drafter
(results/drafter) and evaluation chats (results/data/eval.jsonl).

Closed loop in one process: an Engine per variant, all built first, and at each concurrency c
exactly c requests are in flight (a finished one is replaced at once) until `--requests` have
completed; every request asks for `--max-new` tokens and ignores EOS, so all variants decode the
same number of tokens. The variants take turns: repeat r of a level runs on every engine back to
back, so a machine whose speed drifts over minutes (a shared VM) slows them alike. Output tokens
per second are counted over the whole level. The table gives each variant's rate and each rate
÷ no speculation. `--auto` adds the auto gate.

A second table splits each level's wall time: the share spent inside the engine's timed decode steps
(the step timer the auto gate fits its curves to) and the rest (prefills, the draft's catch-up,
delivering tokens, admitting requests), and gives always-on ÷ no-spec both ways: over wall time, as
a client sees it, and over the timed steps alone, as the auto gate sees it. A third gives always-on's
median step time by running batch at each level.

Below the tables: the accept length the engine counted, whether the greedy outputs of every
speculative variant equal no-spec's token for token in the checkpoint's dtype (on a CPU, bf16
rounds a k+1-token verify and a one-token decode differently, so near-tie argmaxes can flip
there), and the same check in fp32, where rounding cannot flip an argmax and speculation must
be lossless at every gate threshold.
"""

from __future__ import annotations

import shlex
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from common import emit, machine, markdown_table, parser, versions

# ---------------------------------------------------------------- the pure pieces


def rate_cell(rates: list[float]) -> str:
    """Median tokens/s, with the min–max over repeats when there is more than one."""
    med = statistics.median(rates)
    return f"{med:.1f}" if len(rates) == 1 else f"{med:.1f} ({min(rates):.1f}–{max(rates):.1f})"


def table_rows(rates: dict[tuple[str, int], list[float]], variants: list[str], concurrencies: list[int]) -> list[list[str]]:
    """One row per concurrency: each variant's rate, then variants[1:] ÷ variants[0] (medians)."""
    rows = []
    for c in concurrencies:
        med = [statistics.median(rates[(v, c)]) for v in variants]
        rows.append([str(c)] + [rate_cell(rates[(v, c)]) for v in variants] + [f"{m / med[0]:.2f}" for m in med[1:]])
    return rows


# ---------------------------------------------------------------- the machine


# ---------------------------------------------------------------- the closed loop


def closed_loop(engine, prompts: list[list[int]], concurrency: int, requests: int, max_new: int):
    """Keep `concurrency` requests in flight until `requests` are done; (output tok/s, outputs by request,
    timing). timing is (wall_s, step_s, step_tokens, steps): the loop's wall seconds, the seconds and tokens
    of the engine's timed decode steps within it, and those steps as (side, batch, tokens, seconds)."""
    def timed():  # (seconds, tokens, steps) of every timed decode step so far
        counters = engine.step_counters.values()
        return sum(c[3] for c in counters), sum(c[2] for c in counters), sum(c[0] for c in counters)

    before = timed()
    outputs: dict[int, list[int]] = {}
    lock, done = threading.Lock(), threading.Event()
    state = {"next": 0, "finished": 0}

    def launch():
        i = state["next"]
        state["next"] += 1
        out: list[int] = []
        outputs[i] = out

        def on_done(reason, error):  # on the engine thread: start the replacement at once
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
    after = timed()
    new_steps = after[2] - before[2]  # the engine keeps its last steps as (side, batch, tokens, seconds)
    timing = (elapsed, after[0] - before[0], after[1] - before[1], list(engine.steps)[-new_steps:] if new_steps else [])
    return sum(len(o) for o in outputs.values()) / elapsed, outputs, timing


def step_rows(steps: dict[int, list[tuple]], side: str = "spec") -> list[list[str]]:
    """Per level and running batch: the median time of `side`'s steps (ms) and their count. A closed loop of few
    requests ends in a tail at smaller batches, when only its last requests are left."""
    rows = []
    for c, level in sorted(steps.items()):
        by_batch: dict[int, list[float]] = {}
        for s, batch, _, seconds in level:
            if s == side:
                by_batch.setdefault(batch, []).append(seconds * 1e3)
        rows += [[str(c), str(b), f"{statistics.median(t):.1f}", str(len(t))] for b, t in sorted(by_batch.items())]
    return rows


def split_rows(split: dict[tuple[str, int], list[tuple[float, float, float]]], concurrencies: list[int]) -> list[list[str]]:
    """Per level: the share of wall time in timed decode steps for no-spec and always-on, and always-on ÷ no-spec
    over wall time and over the timed steps alone (sums over repeats)."""
    rows = []
    for c in concurrencies:
        wall, step, tokens = ({v: sum(x[i] for x in split[(v, c)]) for v in ("nospec", "always")} for i in range(3))
        wall_rate = {v: tokens[v] / wall[v] for v in wall}  # every token comes from a timed step
        step_rate = {v: tokens[v] / step[v] for v in step}
        rows.append([str(c), f"{step['nospec'] / wall['nospec']:.2f}", f"{step['always'] / wall['always']:.2f}",
                     f"{wall_rate['always'] / wall_rate['nospec']:.2f}", f"{step_rate['always'] / step_rate['nospec']:.2f}"])
    return rows


def eval_prompts(engine, eval_jsonl: str, n: int) -> list[list[int]]:
    """First user turns of the evaluation chats, short enough for the engine's context."""
    from specgate.files import read_jsonl
    from specgate.model.chat import prompt_ids

    prompts = [prompt_ids(engine.tokenizer, r["messages"][:1]) for r in read_jsonl(eval_jsonl)]
    return [p for p in prompts if len(p) < 600][:n]


def fp32_lossless_check(target: str, draft: str, eval_jsonl: str, *, num_steps: int, device: str, concurrency: int = 4,
                        requests: int = 12, max_new: int = 48, gates=(None, 2, 3)) -> dict:  # fmt: skip
    """Greedy outputs of no-spec, always-on and gated engines in fp32, where rounding cannot flip an argmax."""
    from specgate.engine.reference import Engine, EngineConfig
    from specgate.gate import GateConfig

    outs, switches = {}, 0
    for name, d, gate in [("nospec", None, None)] + [(f"spec_{g}", draft, g) for g in gates]:
        engine = Engine(EngineConfig(target, d, num_steps, GateConfig(gate), max_running=concurrency, max_len=1024,
                                     device=device, dtype="float32"))  # fmt: skip
        outs[name] = closed_loop(engine, eval_prompts(engine, eval_jsonl, requests), concurrency, requests, max_new)[1]
        switches += engine.gate.counters()["switches"]
        engine.shutdown()
    return {"identical": all(o == outs["nospec"] for o in outs.values()), "requests": requests, "max_new": max_new,
            "concurrency": concurrency, "gates": ["always" if g is None else g for g in gates], "switches": switches}  # fmt: skip


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--target", default="results/target", help="materialised target (default: %(default)s)")
    p.add_argument("--draft", default="results/drafter", help="exported drafter (default: %(default)s)")
    p.add_argument("--eval", default="results/data/eval.jsonl", help="evaluation chats (default: %(default)s)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16], help="requests in flight (default: 1 4 16)")
    p.add_argument("--threshold", type=int, default=4, help="gate off at this many running requests (default: %(default)s)")
    p.add_argument("--num-steps", type=int, default=3, help="draft steps per speculative step (default: %(default)s)")
    p.add_argument("--max-new", type=int, default=64, help="new tokens per request (default: %(default)s)")
    p.add_argument("--requests", type=int, default=16, help="requests per concurrency level, at least c (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=1, help="measurements per level (the min–max is the noise)")
    p.add_argument("--auto", action="store_true", help="also the auto gate (no threshold)")
    p.add_argument("--no-fp32-check", action="store_true", help="skip the fp32 token-for-token check")
    p.add_argument("--device", default="cpu", help="cpu (what the reference engine is for) or cuda (default: %(default)s)")
    p.add_argument("--out", help="write the Markdown table here too")
    args = p.parse_args(argv)

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("error: --device cuda but torch sees no GPU (torch " + torch.__version__ + ")")
    for flag, what, path in (("--target", "target", args.target), ("--draft", "drafter", args.draft),
                             ("--eval", "evaluation set", args.eval)):  # fmt: skip
        if not Path(path).exists():
            sys.exit(f"error: no {what} at {path} (the workflow writes it there; or pass {flag})")
    from specgate.engine.reference import Engine, EngineConfig
    from specgate.gate import AutoConfig, GateConfig

    concurrencies = args.concurrency
    variants = {"nospec": (None, GateConfig(None)), "always": (args.draft, GateConfig(None)),
                f"gate_{args.threshold}": (args.draft, GateConfig(args.threshold))}  # fmt: skip
    if args.auto:
        variants["auto"] = (args.draft, AutoConfig())
    engines = {name: Engine(EngineConfig(args.target, draft, args.num_steps, gate, max_running=max(concurrencies),
                                         max_len=1024, device=args.device))
               for name, (draft, gate) in variants.items()}  # fmt: skip
    dtype = str(engines["nospec"].decoder.target.dtype).removeprefix("torch.")
    prompts = eval_prompts(engines["nospec"], args.eval, 32)
    for engine in engines.values():
        closed_loop(engine, prompts, 1, 2, 8)  # warm-up
    rates: dict[tuple[str, int], list[float]] = {}
    split: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    always_steps: dict[int, list[tuple]] = {}  # always-on's steps by level, every repeat
    outputs = {}
    for c in concurrencies:
        for i in range(args.repeats):
            for name, engine in engines.items():
                tps, outs, timing = closed_loop(engine, prompts, c, max(args.requests, c), args.max_new)
                rates.setdefault((name, c), []).append(tps)
                split.setdefault((name, c), []).append(timing[:3])
                if name == "always":
                    always_steps.setdefault(c, []).extend(timing[3])
                if i == 0:
                    outputs[(name, c)] = outs
                print(f"{name} concurrency {c} repeat {i + 1}: {tps:.1f} tok/s", file=sys.stderr)
    accept = {name: engine.stats()["avg_spec_accept_length"] for name, engine in engines.items()}
    auto = engines["auto"].gate.counters() if args.auto else None
    for engine in engines.values():
        engine.shutdown()
    lossless = all(outputs[(n, c)] == outputs[("nospec", c)] for n in variants for c in concurrencies)

    names = list(variants)
    columns = ["concurrency"] + [f"{n} tok/s" for n in names] + [f"{n} ÷ nospec" for n in names[1:]]
    accept_lengths = ", ".join(f"{n} {accept[n]:.3f}" if accept[n] is not None else f"{n} –" for n in names[1:])
    notes = [
        f"Accept length (engine counter): {accept_lengths}.",
        f"{dtype} (as benchmarked): greedy outputs of every variant identical to no-spec at every level: {lossless}.",
    ]
    if auto:
        lines = "; ".join(f"{side}: " + ", ".join(f"{b:g} → {ms:.1f} ms" for b, ms in pts) for side, pts in auto["lines"].items())
        notes.append(f"The auto gate at the end: threshold {auto['auto_threshold']}, tau {auto['tau']}, {auto['probes']} "
                     f"probes; its step-time curves (batch → ms) {lines}.")  # fmt: skip
    if not args.no_fp32_check:
        exact = fp32_lossless_check(args.target, args.draft, args.eval, num_steps=args.num_steps, device=args.device)
        notes.append(f"fp32 check ({exact['requests']} requests × {exact['max_new']} tokens at concurrency "
                     f"{exact['concurrency']}, gates {exact['gates']}): every variant identical to no-spec token for token: "
                     f"{exact['identical']}; gated runs switched {exact['switches']} times.")  # fmt: skip
    text = "\n".join([
        "# Reference engine: no speculation vs EAGLE-3 always on vs gated",
        "",
        f"`python {shlex.join(sys.argv if argv is None else ['benchmarks/reference_engine.py', *argv])}` · "
        f"{machine(args.device)} · {versions()} · {args.repeats} measurement{'s' if args.repeats > 1 else ''} per level",
        "",
        f"Target `{args.target}` in {dtype}, drafter `{args.draft}`, {args.num_steps} draft steps, greedy, {args.max_new} new "
        f"tokens per request (ignore_eos), closed loop, {args.requests} requests per level (at least the concurrency); "
        f"gate off at {args.threshold} running requests{'; and the auto gate' if args.auto else ''}; variants in turn at each repeat.",
        "",
        markdown_table(columns, table_rows(rates, names, concurrencies)),
        "",
        markdown_table(["concurrency", "no-spec: share of wall time in timed steps", "always-on: share in timed steps",
                        "always ÷ nospec, wall", "always ÷ nospec, timed steps"], split_rows(split, concurrencies)),
        "",
        "Always-on's speculative steps by running batch (the engine's timer):",
        "",
        markdown_table(["concurrency", "running batch", "median step ms", "steps"], step_rows(always_steps)),
        "",
        *notes,
        "",
    ])  # fmt: skip
    emit(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
