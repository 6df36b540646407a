"""Cost model: per-step time against batch size, and the throughput it predicts.

Data: the sweep's measured `nospec` and `always` levels. In a closed loop at concurrency
c the running batch is about c, and each step emits 1 token per request without
speculation and τ (the level's accept length) with it. So the effective step time is

    t_plain(c) = c / throughput_nospec(c)        t_spec(c) = c · τ / throughput_always(c)

which includes prefill and scheduling amortised over the steps, as the client sees them.
Both are fitted as lines in the batch size, t(b) = fixed + per_request · b (least squares),
the usual shape of a memory-bound decode step plus per-request attention and sampling.

Prediction: no-spec throughput c / t_plain(c); speculative c · τ / t_spec(c); a gate at T
speculates while the batch is below T. Speculation pays while τ · t_plain(b) > t_spec(b), so
the crossover is b* = (τ · fixed_plain − fixed_spec) / (per_request_spec − τ · per_request_plain),
and the predicted threshold is the smallest integer above it: speculate at b < T = ⌊b*⌋ + 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd


@dataclass
class Line:
    fixed: float  # seconds per step
    per_request: float  # seconds per running request per step

    def __call__(self, b):
        return self.fixed + self.per_request * np.asarray(b, dtype=float)


def fit_line(batch, seconds) -> Line:
    batch, seconds = np.asarray(batch, float), np.asarray(seconds, float)
    if len(batch) == 1:
        return Line(float(seconds[0]), 0.0)
    # Weighted by 1/seconds: relative residuals. Throughput is tokens / step time, so a relative
    # error in a step time is the same relative error in that level's predicted throughput. Plain
    # least squares lets the largest batches (the longest steps) set the line, and the fixed cost it
    # leaves, which decides the crossover, was 13% high for the speculative step on the 8B-cost sweep.
    per_request, fixed = np.polyfit(batch, seconds, 1, w=1.0 / seconds)
    return Line(float(fixed), float(per_request))


@dataclass
class CostModel:
    plain: Line
    spec: Line
    tau: float

    def nospec_throughput(self, c):
        return np.asarray(c, float) / self.plain(c)

    def spec_throughput(self, c):
        return np.asarray(c, float) * self.tau / self.spec(c)

    def gated_throughput(self, c, threshold: int):
        c = np.asarray(c, float)
        return np.where(c < threshold, self.spec_throughput(c), self.nospec_throughput(c))

    def crossover(self) -> float:
        """Batch size where speculation stops paying: inf if it always pays, 0 if never."""
        gain_fixed = self.tau * self.plain.fixed - self.spec.fixed  # > 0: pays at small batch
        slope = self.spec.per_request - self.tau * self.plain.per_request  # > 0: the gain shrinks with batch
        if slope <= 0:
            return math.inf if gain_fixed > 0 else 0.0
        return max(gain_fixed / slope, 0.0)

    def threshold(self) -> float:
        b = self.crossover()
        return math.inf if math.isinf(b) else math.floor(b) + 1


def auto_seed(model: CostModel) -> dict:
    """The auto gate's starting model (`specgate.gate.AutoConfig.seed`) from a sweep's cost model: each side's
    line, in seconds and seconds per request, and tau."""
    return {"plain": [model.plain.fixed, model.plain.per_request], "spec": [model.spec.fixed, model.spec.per_request],
            "tau": model.tau}  # fmt: skip


def step_times(summary: pd.DataFrame) -> pd.DataFrame:
    """Effective step seconds per level of the nospec and always variants."""
    rows = []
    for _, r in summary[summary.variant.isin(["nospec", "always"])].iterrows():
        tokens_per_step = 1.0 if r.variant == "nospec" else float(r.accept_length)
        rows.append({"variant": r.variant, "batch": int(r.concurrency),
                     "step_s": r.concurrency * tokens_per_step / r.output_throughput})  # fmt: skip
    return pd.DataFrame(rows)


def always_on_tau(summary: pd.DataFrame) -> float:
    """Always-on's accept length over the sweep, each level weighted by the tokens it produced; nan without it."""
    always = summary[summary.variant == "always"].dropna(subset=["accept_length"])
    if always.empty:
        return float("nan")
    return float(np.average(always.accept_length.astype(float), weights=always.total_output_tokens))


def fit(summary: pd.DataFrame) -> tuple[CostModel, pd.DataFrame]:
    steps = step_times(summary)
    plain = steps[steps.variant == "nospec"]
    spec = steps[steps.variant == "always"]
    if plain.empty or spec.empty:
        raise ValueError("the cost model needs the nospec and always variants in the sweep")
    model = CostModel(fit_line(plain.batch, plain.step_s), fit_line(spec.batch, spec.step_s), always_on_tau(summary))
    return model, steps


def envelope_efficiency(summary: pd.DataFrame) -> pd.DataFrame:
    """Per variant: min over concurrencies of thr(variant) / max(thr(nospec), thr(always))."""
    thr = summary.pivot_table(index="concurrency", columns="variant", values="output_throughput")
    best = thr[["nospec", "always"]].max(axis=1)
    rows = []
    for v in thr.columns:
        ratio = thr[v] / best
        rows.append({"variant": v, "envelope_efficiency": float(ratio.min()), "worst_concurrency": int(ratio.idxmin()),
                     "mean_efficiency": float(ratio.mean())})  # fmt: skip
    return pd.DataFrame(rows)


def predicted_envelope(model: CostModel, concurrencies, threshold: int) -> float:
    c = np.asarray(concurrencies, float)
    best = np.maximum(model.nospec_throughput(c), model.spec_throughput(c))
    return float(np.min(model.gated_throughput(c, threshold) / best))


def measured_crossover(summary: pd.DataFrame) -> float:
    """First concurrency where no-spec matches or beats always-on, interpolated between levels."""
    thr = summary.pivot_table(index="concurrency", columns="variant", values="output_throughput").sort_index()
    gain = (thr["always"] / thr["nospec"] - 1.0).to_numpy()
    cs = thr.index.to_numpy(float)
    if gain[0] <= 0:
        return 0.0
    for i in range(1, len(cs)):
        if gain[i] <= 0:
            return float(cs[i - 1] + (cs[i] - cs[i - 1]) * gain[i - 1] / (gain[i - 1] - gain[i]))
    return math.inf
