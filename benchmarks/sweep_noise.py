"""How noisy is this host for the sweep? Two servers doing the same work, measured the sweep's way.

A no-spec server and a speculative server whose gate is held off at every batch (gate_1: every decode
step a plain step) take turns in blocks at one concurrency, on the same requests, in the sweep's
`rotate` and `sandwich` orders. Both do the same work per step, so the spread of the block ratios is
the measurement's own noise, and the ratio beside the servers' own plain-step times says whether the
client measures the servers:

    python benchmarks/sweep_noise.py --target results/target --drafter results/drafter \\
        --eval results/data/eval.jsonl --concurrency 8 --turns 12 --window 2

Prints, per order, the ratio's mean, its relative standard deviation over blocks, and the same for the
servers' step-time ratio; `--out FILE` also writes the page.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

import pandas as pd
from common import emit, machine, markdown_table, parser, versions

from specgate.files import read_jsonl
from specgate.sweep.bench import request_lengths
from specgate.sweep.load_client import Entry, Load, bench_requests, sweep_blocks
from specgate.sweep.managed_server import ManagedServer, free_port


def parse_args(argv=None):
    p = parser(__doc__)
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--eval", required=True, help="eval conversations (results/data/eval.jsonl)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--turns", type=int, default=12)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--window", type=float, default=2.0)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--max-running", type=int, default=8)
    p.add_argument("--orders", nargs="+", default=["rotate", "sandwich"])
    p.add_argument("--out", help="also write the page here")
    return p.parse_args(argv)


def serve(a, port: int, control: str | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "specgate.cli", "serve", "--target", a.target, "--port", str(port), "--max-running",
           str(a.max_running), "--max-len", "1536"]  # fmt: skip
    return cmd + (["--draft", a.drafter, "--gate-control", control] if control else [])


def main(argv=None) -> pd.DataFrame:
    a = parse_args(argv)
    requests = bench_requests(list(read_jsonl(a.eval)), a.prompts, 0)
    prompts = [p for p, _ in requests]
    lengths = request_lengths({"lengths": "replies", "max_tokens": a.max_tokens}, [r for _, r in requests], a.target)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        control = str(Path(tmp) / "gate_control.json")
        p1, p2 = free_port(), free_port()
        with ManagedServer(serve(a, p1), p1, Path(tmp) / "nospec.log") as base, \
             ManagedServer(serve(a, p2, control), p2, Path(tmp) / "spec.log") as spec:  # fmt: skip
            entries = [Entry("nospec", base.url, baseline=True),
                       Entry("gate_1", spec.url, gate={"disable_at": 1}, control=control)]  # fmt: skip
            for order in a.orders:
                _, rows = asyncio.run(sweep_blocks(
                    entries, "m", prompts, lengths, [Load(concurrency=a.concurrency)], blocks=a.turns,
                    warmup_s=a.warmup, window_s=a.window, rate_window_s=1.0, ignore_eos=True, max_error_rate=0.0,
                    order=order))  # fmt: skip
                g = pd.DataFrame(rows)
                g = g[g.variant == "gate_1"]
                server = g.baseline_server_plain_ms / g.server_plain_ms
                out.append([order, len(g), f"{g.ratio.mean():.3f}", f"{g.ratio.std() / g.ratio.mean():.3f}",
                            f"{server.mean():.3f}", f"{server.std() / server.mean():.3f}",
                            f"{g.baseline_output_throughput.min():.0f}–{g.baseline_output_throughput.max():.0f}"])  # fmt: skip
    head = (f"`python benchmarks/sweep_noise.py --concurrency {a.concurrency} --turns {a.turns} --window {a.window:g}` · "
            f"{machine('cpu')} · {versions()}\n\n")  # fmt: skip
    emit(head + markdown_table(["order", "blocks", "gate-off ÷ no-spec, mean", "its relative sd", "servers' plain-step "
                                "ratio, mean", "its relative sd", "no-spec tok/s, lowest–highest block"], out), a.out)  # fmt: skip
    return out


if __name__ == "__main__":
    main()
