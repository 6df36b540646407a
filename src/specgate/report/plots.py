"""PNG figures for the report: training curves, sweep curves, envelope, cost model.

matplotlib is imported on first use: the Snakefile imports PLOTS, and a no-op
`snakemake` run should not pay for a plotting library.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specgate.files import atomic_path

PLOTS = ("training", "throughput", "latency", "envelope", "cost_model")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    _pyplot().close(fig)


def _variant_order(names) -> list[str]:
    def key(n):  # nospec, always, auto, SGLang's adaptive, then the fixed thresholds in order
        fixed = {"nospec": (0, 0), "always": (1, 0), "auto": (2, 0), "sglang_adaptive": (2, 1)}
        return fixed.get(n) or (3, int(n.split("_")[1]))

    return sorted(names, key=key)


def training(metrics, path: Path) -> None:
    plt = _pyplot()
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    steps = sorted(int(c.split("_")[1]) for c in metrics.columns if c.startswith("acc_"))
    for k in steps:
        ax_loss.plot(metrics.step, metrics[f"loss_{k}"], label=f"TTT step {k}", lw=1)
        ax_acc.plot(metrics.step, metrics[f"acc_{k}"], label=f"acc_{k}", lw=1)
    ax_loss.set(xlabel="optimizer step", ylabel="loss", title="Drafter loss per TTT step")
    ax_acc.set(xlabel="optimizer step", ylabel="top-1 accuracy", title="Drafter accuracy per TTT step")
    ax_acc.legend(fontsize=7)
    _save(fig, path)


def throughput(summary, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for v in _variant_order(summary.variant.unique()):
        d = summary[summary.variant == v].sort_values("concurrency")
        line = ax.plot(d.concurrency, d.output_throughput, marker="o", label=v, lw=2 if v in ("nospec", "always") else 1)
        if "output_throughput_lo" in d:  # the 90% bootstrap interval of each level's median over rounds
            ax.fill_between(d.concurrency, d.output_throughput_lo, d.output_throughput_hi, color=line[0].get_color(), alpha=0.15)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="concurrency", ylabel="output tok/s", title="Throughput against concurrency (bands: 90% intervals)")
    ax.legend()
    _save(fig, path)


def _two_panels(frame, path: Path, *, order_by: str, x: str, columns: tuple, titles: tuple, xlabel: str,
                title: str = "{}", log_x: bool = False) -> None:
    """Two side-by-side panels, one line per variant through its levels."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, col, name in zip(axes, columns, titles, strict=True):
        for v in _variant_order(frame.variant.unique()):
            d = frame[frame.variant == v].sort_values(order_by)
            ax.plot(d[x], d[col], marker="o", label=v)
        if log_x:
            ax.set_xscale("log", base=2)
        ax.set(xlabel=xlabel, ylabel=name, title=title.format(name))
    axes[0].legend()
    _save(fig, path)


def latency(summary, path: Path) -> None:
    _two_panels(summary, path, order_by="concurrency", x="concurrency", columns=("median_ttft_ms", "median_itl_ms"),
                titles=("median TTFT (ms)", "median ITL (ms)"), xlabel="concurrency", log_x=True)


def latency_throughput(cells, path: Path) -> None:
    """Open loop: p99 ITL and p99 TTFT against output throughput, one line per variant through its rates."""
    _two_panels(cells, path, order_by="request_rate", x="output_throughput", columns=("p99_itl_ms", "p99_ttft_ms"),
                titles=("p99 ITL (ms)", "p99 TTFT (ms)"), xlabel="output tok/s",
                title="{} against throughput (points: request rates)")


def envelope(summary, path: Path) -> None:
    thr = summary.pivot_table(index="concurrency", columns="variant", values="output_throughput")
    best = thr[["nospec", "always"]].max(axis=1)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for v in _variant_order(thr.columns):
        ax.plot(thr.index, thr[v] / best, marker="o", label=v)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="concurrency", ylabel="throughput ÷ max(nospec, always)", title="Envelope efficiency")
    ax.legend()
    _save(fig, path)


def cost_model(model, steps, summary, path: Path) -> None:
    plt = _pyplot()
    fig, (ax_t, ax_thr) = plt.subplots(1, 2, figsize=(11, 4))
    grid = np.linspace(1, max(summary.concurrency.max(), 2), 200)
    for variant, line, label in (("nospec", model.plain, "plain step"), ("always", model.spec, "speculative step")):
        d = steps[steps.variant == variant]
        ax_t.scatter(d.batch, d.step_s * 1000, label=f"{label} (measured)")
        ax_t.plot(grid, line(grid) * 1000, label=f"{label} fit")
    ax_t.set(xlabel="batch", ylabel="ms per step", title="Effective step time")
    ax_t.legend(fontsize=7)
    for variant, pred in (("nospec", model.nospec_throughput), ("always", model.spec_throughput)):
        d = summary[summary.variant == variant].sort_values("concurrency")
        ax_thr.scatter(d.concurrency, d.output_throughput, label=f"{variant} measured")
        ax_thr.plot(grid, pred(grid), label=f"{variant} predicted")
    b = model.crossover()
    if np.isfinite(b) and b > 0:
        ax_thr.axvline(b, color="grey", ls="--", lw=0.8, label=f"predicted crossover {b:.1f}")
    ax_thr.set_xscale("log", base=2)
    ax_thr.set(xlabel="concurrency", ylabel="output tok/s", title="Cost model against the sweep")
    ax_thr.legend(fontsize=7)
    _save(fig, path)
