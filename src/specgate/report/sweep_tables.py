"""The report's tables about how the sweep measured: steady window against whole block, the block
noise, the client's ratios against the servers' own step times, and the open-loop levels."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from specgate.report import uncertainty as un


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(lines)


def _f(x, digits=3) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _order(names) -> list[str]:
    from specgate.report.plots import _variant_order

    return _variant_order(names)


def closed(blocks: pd.DataFrame) -> pd.DataFrame:
    return blocks[blocks.request_rate.isna()] if "request_rate" in blocks else blocks


def opened(blocks: pd.DataFrame) -> pd.DataFrame:
    return blocks[blocks.request_rate.notna()] if "request_rate" in blocks else blocks.iloc[0:0]


def describe(config: dict, blocks: pd.DataFrame) -> str:
    bench = config["bench"]
    design = str(blocks.design.iloc[0]) if "design" in blocks else "serial"
    how = {
        "switched": "one no-spec server and one speculative server, whose gate the sweep switched between blocks "
                    "(every speculative variant ran on that one server)",
        "paired": "one job per variant, each with its own no-spec server beside the variant's",
        "serial": "one server per variant, measured one after another with no baseline beside it",
    }[design]  # fmt: skip
    lengths = ("each request asks for its prompt's eval reply length in the target's tokens, truncated at "
               f"{bench['max_tokens']}" if bench["lengths"] == "replies" else f"{bench['max_tokens']} tokens per request")  # fmt: skip
    n = int(closed(blocks).groupby(["variant", "concurrency"]).size().max()) if len(closed(blocks)) else 0
    order = bench.get("order", "rotate")
    turns = ("" if design == "serial" else
             "At each level the servers take turns in blocks on the same requests, "
             + ("each variant's block between two no-spec blocks of the same turn; " if order == "sandwich" else
                "the order rotating each turn; "))  # fmt: skip
    baseline = ("the mean of the two no-spec blocks beside it" if order == "sandwich" else
                "the no-spec block of the same turn")  # fmt: skip
    return (f"Design **{design}**: {how}. {turns}{lengths} (ignore_eos={bench['ignore_eos']}), greedy. A closed-loop block "
            f"keeps c requests in flight and counts the tokens streamed in its steady window: {bench['window_s']:g} s "
            f"after {bench['warmup_s']:g} s of warm-up and every first request's first token; what is in flight at the "
            f"end is cancelled. {n} blocks per cell. A cell is the median over its blocks of the block's ratio to "
            f"{baseline}, times the level's no-spec throughput; latency and accept-length cells are medians of the "
            "blocks' own figures. Per-block rows: "
            "`results/bench/<job>/round<r>.csv`; per-request records beside them; cells and intervals: "
            "`results/report/levels.csv`.")  # fmt: skip


def steadiness_section(blocks: pd.DataFrame) -> list[str]:
    """Each variant's ratio to no-spec at each level, from the steady window and from the whole block,
    with the spread of the steady ratio over blocks, and the pooled noise of one block's ratio."""
    c = closed(blocks)
    if "ratio" not in c or c.ratio.isna().all():
        return []
    variants = [v for v in _order(c.variant.unique()) if not (v == "nospec" and np.allclose(c[c.variant == v].ratio, 1))]
    rows = []
    for conc in sorted(c.concurrency.unique()):
        cells = []
        for v in variants:
            g = c[(c.variant == v) & (c.concurrency == conc)]
            cells.append("-" if g.empty else f"{g.ratio.median():.3f} [{g.ratio.min():.3f}–{g.ratio.max():.3f}] "
                         f"({g.whole_ratio.median():.3f})")  # fmt: skip
        rows.append([int(conc), *cells])
    noise = un.block_noise(c)
    lines = ["", "### Ratio to the no-spec block beside it", "",
             "Median over blocks of the steady-window ratio [lowest–highest block], and in brackets the same from the "
             "whole block (ramp-up and the cancelled tail included).", "",
             _table(["concurrency", *variants], rows)]  # fmt: skip
    if noise is not None:
        by_level = {int(conc): un.block_noise(c[c.concurrency == conc]) for conc in sorted(c.concurrency.unique())}
        levels = ", ".join(f"{conc}: {x:.3f}" for conc, x in by_level.items() if x is not None)
        lines += ["", f"Noise: one block's ratio deviates from its cell's mean by {noise:.3f} (relative standard "
                      f"deviation, pooled over every cell); by concurrency, {levels}. The intervals below are drawn from "
                      "those deviations, each level at its own size (shrunk toward the pooled one), a turn at a time, so "
                      "what a turn does to every variant alike cancels where two are compared."]  # fmt: skip
    return lines


def validity_rows(blocks: pd.DataFrame) -> list[dict]:
    """Cells where a speculative server ran plain steps only: the client's ratio to no-spec beside the
    servers' own: no-spec's mean plain step time ÷ the variant's, at the batch each ran."""
    c = closed(blocks)
    need = {"server_spec_steps", "server_plain_ms", "baseline_server_plain_ms", "ratio"}
    if not need <= set(c.columns):
        return []
    out = []
    for (v, conc), g in c.groupby(["variant", "concurrency"]):
        if v == "nospec" and np.allclose(g.ratio, 1):
            continue
        if g.server_plain_ms.isna().any() or g.baseline_server_plain_ms.isna().any() or (g.server_spec_steps.fillna(0) > 0).any():
            continue
        server = float((g.baseline_server_plain_ms / g.server_plain_ms).median())
        client = float(g.ratio.median())
        out.append({"variant": v, "concurrency": int(conc), "client": client, "server": server,
                    "difference": client - server, "batch": float(g.server_plain_batch.median()),
                    "baseline_batch": float(g.baseline_server_plain_batch.median())
                    if "baseline_server_plain_batch" in g else math.nan})  # fmt: skip
    return out


def validity_section(blocks: pd.DataFrame) -> list[str]:
    rows = validity_rows(blocks)
    if not rows:
        return []
    worst = max(abs(r["difference"]) for r in rows)
    return ["", "### Plain steps: the client's ratio against the servers' own step times", "",
            "Where a speculative server ran plain steps only, its throughput ÷ no-spec (client, steady window) beside "
            "the ratio of the two servers' own mean plain-step times (no-spec's ÷ the variant's, from the engines' step "
            "counters).", "",
            _table(["variant", "concurrency", "client ratio", "server step-time ratio", "difference"],
                   [[r["variant"], r["concurrency"], _f(r["client"]), _f(r["server"]), f"{r['difference']:+.3f}"]
                    for r in sorted(rows, key=lambda r: (r["concurrency"], r["variant"]))]),
            "", f"Largest difference: {worst:.3f}."]  # fmt: skip


def open_loop_cells(blocks: pd.DataFrame) -> pd.DataFrame:
    o = opened(blocks)
    if o.empty:
        return o
    cols = ["output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms",
            "median_e2e_latency_ms", "p99_e2e_latency_ms", "goodput", "goodput_ratio", "ratio"]
    cols = [k for k in cols if k in o]
    cells = o.groupby(["request_rate", "variant"], sort=False)[cols].median().reset_index()
    return cells.join(o.groupby(["request_rate", "variant"], sort=False).size().rename("blocks"), on=["request_rate", "variant"])


def open_loop_section(config: dict, blocks: pd.DataFrame) -> tuple[list[str], dict]:
    """Per request rate and variant: throughput, latencies at p50 / p99 and goodput under the SLO; and the
    variant with the highest goodput at each rate."""
    cells = open_loop_cells(blocks)
    if cells.empty:
        return [], {}
    slo = {k: v for k, v in config["bench"]["slo"].items() if v is not None}
    slo_text = ", ".join(f"{k.removesuffix('_ms')} ≤ {v:g} ms" for k, v in slo.items()) or "none"
    rows, best = [], {}
    for rate in sorted(cells.request_rate.unique()):
        g = cells[cells.request_rate == rate]
        top = g.loc[g.goodput.idxmax()] if "goodput" in g and g.goodput.notna().any() else None
        if top is not None:
            best[float(rate)] = {"variant": top.variant, "goodput": float(top.goodput)}
        for v in _order(g.variant.unique()):
            r = g[g.variant == v].iloc[0]
            rows.append([f"{rate:g}", v, _f(r.output_throughput, 1), _f(r.median_ttft_ms, 0), _f(r.p99_ttft_ms, 0),
                         _f(r.median_itl_ms, 1), _f(r.p99_itl_ms, 1), _f(r.median_e2e_latency_ms, 0),
                         _f(r.p99_e2e_latency_ms, 0), _f(r.get("goodput"), 2), _f(r.get("goodput_ratio"), 3)])  # fmt: skip
    lines = ["", "## Open loop: the operator's traffic", "",
             f"Poisson arrivals at each rate for {config['bench']['rate_window_s']:g} s per block (as `sglang.bench_serving "
             "--request-rate`), every request then run to its end; medians over blocks. Throughput: tokens streamed "
             f"during the arrivals ÷ their span. Goodput: requests within the SLO ({slo_text}) per second.", "",
             _table(["rate (req/s)", "variant", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
                     "E2E p50 ms", "E2E p99 ms", "goodput (req/s)", "goodput ÷ no-spec"], rows), ""]  # fmt: skip
    lines += ["Highest goodput at each rate: " + "; ".join(f"{r:g} req/s: {b['variant']} ({b['goodput']:.2f} req/s)"
                                                           for r, b in best.items()) + "."]  # fmt: skip
    return lines, best
