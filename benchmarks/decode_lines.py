"""SGLang's own throughput, from its decode log lines: a speculative server's plain steps beside a no-spec server.

Every `decode_log_interval` decode steps (40 by default) SGLang logs a line with the running batch and its
generation throughput over those steps. This script takes the lines of two servers' logs whose running batch
is within 5% below a concurrency level, keeps only the speculative server's plain steps (accept len 1.00, or
no accept field), and prints each side's median and their ratio. It is the server-side figure to set beside
the sweep's client ratio where a gated variant ran plain steps only:

    python benchmarks/decode_lines.py --nospec results/logs/bench/all.round0.baseline.server.log \\
        --spec results/logs/bench/all.round0.server.log --concurrency 16 32 64 128
"""

from __future__ import annotations

import re
import statistics

from common import emit, markdown_table, parser

LINE = re.compile(r"Decode batch, #running-req: (\d+),.*?(?:accept len: ([\d.]+),.*?)?gen throughput \(token/s\): ([\d.]+)")


def parse_args(argv=None):
    p = parser(__doc__)
    p.add_argument("--nospec", required=True, help="the no-spec server's log")
    p.add_argument("--spec", required=True, help="the speculative server's log")
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 32, 64, 128])
    p.add_argument("--out", help="also write the page here")
    return p.parse_args(argv)


def decode_lines(path: str, plain_only: bool) -> list[tuple[int, float]]:
    """(running requests, gen tok/s) of each decode line; with plain_only, those of plain steps only."""
    out = []
    with open(path, errors="replace") as f:
        for line in f:
            m = LINE.search(line)
            if m and not (plain_only and m.group(2) is not None and float(m.group(2)) != 1.0):
                out.append((int(m.group(1)), float(m.group(3))))
    return out


def at_level(lines: list[tuple[int, float]], c: int) -> list[float]:
    return [g for running, g in lines if 0.95 * c <= running <= c]


def main(argv=None) -> list[list]:
    a = parse_args(argv)
    base, spec = decode_lines(a.nospec, False), decode_lines(a.spec, True)
    rows = []
    for c in a.concurrency:
        b, s = at_level(base, c), at_level(spec, c)
        if not b or not s:
            rows.append([c, len(b), "-", len(s), "-", "-"])
            continue
        mb, ms = statistics.median(b), statistics.median(s)
        rows.append([c, len(b), f"{mb:,.0f}", len(s), f"{ms:,.0f}", f"{ms / mb:.3f}"])
    head = f"`python benchmarks/decode_lines.py --concurrency {' '.join(map(str, a.concurrency))}`\n\n"
    emit(head + markdown_table(["c", "no-spec lines", "no-spec tok/s, median", "plain-step lines (speculative server)",
                                "their tok/s, median", "ratio"], rows), a.out)  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
