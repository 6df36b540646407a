"""How sure the sweep is: medians over replicates, bootstrap intervals, and a recommendation that
says when its candidates are within noise of each other.

A replicate is one block of a level (`specgate.sweep.load_client`): its steady-window throughput
÷ the no-spec block of the same turn, measured seconds before or after it on the same requests.
The figure a cell decides on is that ratio times the level's no-spec throughput (the median of
every no-spec block at that level), so cells keep their tok/s scale while the server-to-server
and minute-to-minute drift, which both blocks of a turn share, cancels (`replicates`). A sweep
measured without a baseline beside it (bench.side_by_side false) decides on raw throughput.

Replicates are few, 3 by default, and a bootstrap over 3 values cannot see past them: the median
of 3 draws from 3 values never leaves their range. So the noise is pooled: each replicate's
deviation from its cell's mean (relative, scaled by sqrt(n / (n - 1))) is pooled over every
level of the sweep, and each cell is redrawn as its median times (1 + pooled deviations), one
per replicate. The pool gives the shape of the noise; its size is each level's own. A GPU server
at c = 1 repeats to a few percent while the same server at c = 128 moves by 10-20% from block
to block, and one size for every level let the loud levels hide a gain that every block of a
quiet level showed. So each level's deviations are divided by that level's spread before they
are pooled, and multiplied by it when they are drawn; a level's spread is its own, shrunk toward
the sweep's by `PRIOR_DOF` degrees of freedom, since a level has few blocks. A turn's deviations
are drawn as one row, every variant's together: a turn's no-spec block and its requests'
acceptance move every variant of that turn alike, and drawn together they cancel where two
variants are compared. The statistic is the
median over replicates, as the point estimate is. The redraws center on the median, not the mean:
one slow block pulls a mean of 3 far enough that its interval would miss the median it stands
for. With a single replicate there are no deviations to pool, and the requests are resampled
instead (Little's law: tokens ÷ end-to-end seconds). Intervals are the 5th to 95th percentiles
(90%).

The decision rule (`decide`) works on the same bootstrap draws:

- Speculation **loses** at a level when always-on beats no-spec in ≤ 5% of draws.
  "Serve without speculation" needs a loss at every level.
- It **pays** at a level when always-on wins in ≥ 1 - 5%/L of draws, L being the number of
  levels: any one of L levels may pay by chance, so each is held to 5%/L. With a pay at no
  level, speculation is "break-even"; with one, the report recommends a gate.
- A gate is **within noise** of the best one (highest envelope efficiency) when its envelope
  efficiency reaches the best's in ≥ 10% of draws. Levels where the two gates made the same
  decisions (shares of decode steps speculated within 2 points: both off, or both on) do not
  count: there the two servers ran the same steps and any difference is the measurement's own,
  so the gate is drawn as the best one there. From that set the report picks the most
  conservative gate: the lowest threshold, which stops speculating first as load grows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd

DRAWS = 2000
INTERVAL = (5.0, 95.0)
SURE = 0.95  # share of draws for "pays" (and 1 - SURE for "loses")
TIE = 0.10  # share of draws in which a gate reaches the best one's envelope efficiency
SAME_DECISIONS = 0.02  # shares of decode steps speculated this close count as the same decisions
PRIOR_DOF = 4  # the weight, in degrees of freedom, of the sweep's spread in each level's own


def replicates(blocks: pd.DataFrame) -> pd.DataFrame:
    """The closed-loop blocks as the replicates the decision works on: `output_throughput` becomes the
    block's ratio to the no-spec block beside it times the level's no-spec throughput (the block's own
    figure stays as `measured_throughput`), and `round` numbers the replicate (round x blocks + block)."""
    closed = blocks[blocks.request_rate.isna()].copy() if "request_rate" in blocks else blocks.copy()
    closed["measured_throughput"] = closed.output_throughput
    if "block" in closed:
        closed["round"] = closed["round"] * (int(closed.block.max()) + 1) + closed.block
    if "ratio" in closed and closed.ratio.notna().all():
        reference = closed.groupby("concurrency").baseline_output_throughput.median()
        closed["output_throughput"] = closed.ratio * closed.concurrency.map(reference)
    return closed


def block_noise(blocks: pd.DataFrame) -> float | None:
    """The spread of one block's ratio: the standard deviation of each ratio's relative deviation from
    its cell's mean, pooled over every cell with two or more blocks (cells whose ratio is 1 by
    construction, the switched sweep's no-spec, left out). None without ratios."""
    if "ratio" not in blocks or blocks.ratio.isna().all():
        return None
    devs = []
    for _, g in blocks.groupby(["variant", "concurrency"]):
        x = g.ratio.to_numpy(float)
        if len(x) > 1 and not np.allclose(x, 1.0):
            devs.append((x / x.mean() - 1) * np.sqrt(len(x) / (len(x) - 1)))
    return float(np.sqrt(np.mean(np.concatenate(devs) ** 2))) if devs else None


def level_spread(devs: pd.DataFrame, prior_dof: float = PRIOR_DOF) -> dict:
    """Per level (the index's first level): (its own relative sd, that sd shrunk toward the sweep's).

    `devs` holds each replicate's relative deviation from its cell's mean, rows by (level, turn), a
    column per variant. Columns that never deviate (the switched sweep's no-spec, 1 by construction)
    carry no noise and are left out. A level's own variance has (turns - 1) x variants degrees of
    freedom; `prior_dof` more come from the variance of every level together."""
    live = devs.loc[:, ~np.isclose(devs.fillna(0), 0).all(axis=0)]
    if live.shape[1] == 0:
        return {c: (0.0, 0.0) for c in devs.index.get_level_values(0).unique()}
    sweep = float(np.nanmean(live.to_numpy() ** 2))
    out = {}
    for c, g in live.groupby(level=0):
        own, dof = float(np.nanmean(g.to_numpy() ** 2)), (len(g) - 1) * g.shape[1]
        # shrunk on a log scale: a variance estimate errs by a factor, and the loud levels must not set the
        # size of a quiet one (on the variance itself the sweep's term dominates whatever the level shows)
        log_var = (dof * np.log(max(own, 1e-12)) + prior_dof * np.log(max(sweep, 1e-12))) / max(dof + prior_dof, 1e-12)
        out[c] = (np.sqrt(own), float(np.exp(log_var / 2)))
    return out


def aggregate_rounds(rounds: pd.DataFrame) -> pd.DataFrame:
    """One row per variant and level: the median over rounds of every measured column; counts summed."""
    keys = ["variant", "concurrency"]
    summed = ["completed", "cancelled", "failed", "total_output_tokens", "duration", "gate_steps_on", "gate_steps_off",
              "gate_switches", "gate_probes", "gate_flushes",
              "spec_verify", "spec_accepted", "spec_verify_resumed", "spec_accepted_resumed"]
    first = ["engine", "server_version", "disable_at", "enable_at", "gate_mode", "accept_length_source", "design",
             "first"]
    numeric = [c for c in rounds.columns if c not in keys + summed + first + ["round", "errors", "request_rate"]
               and pd.api.types.is_numeric_dtype(rounds[c])]  # fmt: skip
    g = rounds.groupby(keys, sort=False)
    out = g[numeric].median()
    out = out.join(g[[c for c in summed if c in rounds]].sum(min_count=1))
    out = out.join(g[[c for c in first if c in rounds]].first())
    out["rounds"] = g.size()
    out["errors"] = g["errors"].agg(lambda e: "; ".join(sorted({str(x) for x in e.dropna() if str(x)})) or np.nan)
    out["error_rate"] = out.failed / (out.completed + out.failed).clip(lower=1)
    return out.reset_index()


def bootstrap_levels(rounds: pd.DataFrame, records: pd.DataFrame, draws: int = DRAWS, seed: int = 0) -> dict:
    """(variant, concurrency) -> `draws` bootstrap replicates of the median-over-rounds throughput."""
    rng = np.random.default_rng(seed)
    cells = {(v, int(c)): g.output_throughput.to_numpy(float) for (v, c), g in rounds.groupby(["variant", "concurrency"])}
    turns = rounds.pivot_table(index=["concurrency", "round"], columns="variant", values="output_throughput")
    out = {}
    if turns.notna().all().all() and turns.groupby(level=0).size().min() > 1:
        # A turn's deviations are drawn as one row, every variant's together: what the turn's requests do to
        # every speculative variant alike (their acceptance, their lengths) moves them together in a draw, so a
        # comparison between variants sees only what differs within a turn. Rows are pooled over levels, each
        # relative to its cell's mean and scaled by sqrt(n / (n - 1)) for the mean they were taken from.
        n = turns.groupby(level=0).transform("size").to_numpy()[:, None]
        devs = ((turns / turns.groupby(level=0).transform("mean") - 1) * np.sqrt(n / (n - 1)))
        spread = level_spread(devs)
        standard = devs.div(devs.index.get_level_values(0).map(lambda c: spread[c][0]).to_numpy(), axis=0)
        pooled = standard[np.isfinite(standard).all(axis=1)].to_numpy()
        if not len(pooled):  # no block deviated from its cell at any level: nothing to redraw
            pooled = np.zeros((1, turns.shape[1]))
        for c, g in turns.groupby(level=0):
            rows = pooled[rng.integers(0, len(pooled), size=(draws, len(g)))] * spread[c][1]  # [draws, replicates, variants]
            drawn = np.median(g.median().to_numpy() * (1 + rows), axis=1)
            out.update({(v, int(c)): drawn[:, j] for j, v in enumerate(turns.columns)})
        return out
    # Replicates not aligned across variants: each cell drawn alone from the deviations of every cell
    pooled = np.concatenate([(x / x.mean() - 1) * np.sqrt(len(x) / (len(x) - 1)) for x in cells.values() if len(x) > 1]
                            or [np.empty(0)])  # fmt: skip
    if len(pooled):
        for key, x in cells.items():
            dev = pooled[rng.integers(0, len(pooled), size=(draws, len(x)))]
            out[key] = np.median(np.median(x) * (1 + dev), axis=1)
        return out
    # One round: only the requests of that round to go by (Little's law on resampled requests)
    ok = records[records.error.isna() & (records.e2e_s > 0)] if len(records) else records
    by_cell = {(v, int(c)): g for (v, c), g in ok.groupby(["variant", "concurrency"])} if len(ok) else {}
    for key, x in cells.items():
        reqs = by_cell.get(key)
        if reqs is None or len(reqs) < 2:
            out[key] = np.full(draws, x[0])
            continue
        tok, e2e = reqs.output_tokens.to_numpy(float), reqs.e2e_s.to_numpy(float)
        idx = rng.integers(0, len(tok), size=(draws, len(tok)))
        out[key] = x[0] * (tok[idx].sum(1) / e2e[idx].sum(1)) / (tok.sum() / e2e.sum())
    return out


def intervals(levels: pd.DataFrame, boot: dict, rounds: pd.DataFrame | None = None) -> pd.DataFrame:
    """`levels` with output_throughput_lo / _hi: the 90% interval of each level's median. A cell that is
    every ratio's denominator (the switched sweep's no-spec) has no spread in the ratios; with `rounds`,
    its interval is the 5th-95th percentile of its own blocks' measured throughput instead."""
    lo, hi = [], []
    for v, c in zip(levels.variant, levels.concurrency, strict=True):
        draws = boot[(v, int(c))]
        if np.ptp(draws) == 0 and rounds is not None and "measured_throughput" in rounds:
            draws = rounds[(rounds.variant == v) & (rounds.concurrency == c)].measured_throughput.to_numpy(float)
        lo.append(np.percentile(draws, INTERVAL[0]) if len(draws) else np.nan)
        hi.append(np.percentile(draws, INTERVAL[1]) if len(draws) else np.nan)
    return levels.assign(output_throughput_lo=lo, output_throughput_hi=hi)


@dataclass
class Decision:
    verdict: str  # "gate": pays somewhere, loses somewhere; "no loss": pays, loses nowhere; "break-even"; "no speculation"
    pick: str | None  # the recommended gate (also for "if it must stay on")
    best: str | None  # the gate with the highest envelope efficiency
    within_noise: list[str]  # gates within noise of the best, the best included
    same_decisions: dict[str, list[int]] = field(default_factory=dict)  # gate -> levels where it decided as the best
    envelope: dict[str, list[float]] = field(default_factory=dict)  # variant -> [point, lo, hi]
    mean_efficiency: dict[str, float] = field(default_factory=dict)
    worst_concurrency: dict[str, int] = field(default_factory=dict)
    pays: list[int] = field(default_factory=list)  # levels where always-on beats no-spec beyond noise (5%/L each)
    loses: list[int] = field(default_factory=list)  # levels where it loses beyond noise
    auto_ratio: list[float] | None = None  # auto's envelope ÷ the best gate's: [point, lo, hi], with auto swept
    versus_sglang: dict[str, list[float]] = field(default_factory=dict)  # best gate, auto -> ÷ sglang_adaptive's
    rule: str = ("within noise: envelope efficiency reaches the best gate's in >= 10% of bootstrap draws; "
                 "counted only at levels where the two gates' shares of steps speculated differ by more than 2 points; "
                 "from that set, the lowest threshold")  # fmt: skip

    def to_dict(self) -> dict:
        return asdict(self)


def _threshold_key(variant: str, levels: pd.DataFrame):
    row = levels[levels.variant == variant].iloc[0]
    hysteresis = not pd.isna(row.get("enable_at", np.nan))
    return (float(row.disable_at), hysteresis, variant)


def speculated_share(levels: pd.DataFrame) -> dict[tuple[str, int], float]:
    """(variant, concurrency) -> the share of decode steps its gate speculated; only where the server counts them."""
    if not {"gate_steps_on", "gate_steps_off"} <= set(levels):
        return {}
    steps = levels.gate_steps_on + levels.gate_steps_off
    share = levels.gate_steps_on / steps.where(steps > 0)
    return {(v, int(c)): float(s) for v, c, s in zip(levels.variant, levels.concurrency, share, strict=True)
            if not pd.isna(s)}  # fmt: skip


def decide(levels: pd.DataFrame, boot: dict, tie: float = TIE, sure: float = SURE) -> Decision:
    """The recommendation from the level medians (`aggregate_rounds`) and their bootstrap draws."""
    concurrencies = sorted(int(c) for c in levels.concurrency.unique())
    variants = list(dict.fromkeys(levels.variant))
    thr = levels.pivot_table(index="concurrency", columns="variant", values="output_throughput")
    best_point = thr[["nospec", "always"]].max(axis=1)
    draws = {v: np.stack([boot[(v, c)] for c in concurrencies], axis=1) for v in variants}  # [draws, levels]
    best_draws = np.maximum(draws["nospec"], draws["always"])
    decision = Decision(verdict="gate", pick=None, best=None, within_noise=[])
    eff_draws = {}
    for v in variants:
        ratio = thr[v] / best_point
        eff_draws[v] = (draws[v] / best_draws).min(axis=1)
        decision.envelope[v] = [float(ratio.min()), *(float(np.percentile(eff_draws[v], q)) for q in INTERVAL)]
        decision.mean_efficiency[v] = float(ratio.mean())
        decision.worst_concurrency[v] = int(ratio.idxmin())
    wins = (draws["always"] > draws["nospec"]).mean(axis=0)
    # "pays at some level" is a claim about any of L levels: each is held to 5% / L (Bonferroni).
    # "loses at every level" needs each level to lose at 5% on its own.
    decision.pays = [c for c, p in zip(concurrencies, wins, strict=True) if p >= 1 - (1 - sure) / len(concurrencies)]
    decision.loses = [c for c, p in zip(concurrencies, wins, strict=True) if p <= 1 - sure]
    if len(decision.loses) == len(concurrencies):
        decision.verdict = "no speculation"
    elif not decision.pays:
        decision.verdict = "break-even"
    elif not decision.loses:
        decision.verdict = "no loss"  # the sweep stopped below the load where speculation stops paying
    gates = [v for v in variants if v.startswith("gate_")]
    if gates:
        best = max(gates, key=lambda g: (round(decision.envelope[g][0], 3), decision.mean_efficiency[g]))
        decision.best = best
        share = speculated_share(levels)
        tied = []
        for g in gates:
            same = [c for c in concurrencies if (g, c) in share and (best, c) in share
                    and abs(share[(g, c)] - share[(best, c)]) <= SAME_DECISIONS]  # fmt: skip
            decision.same_decisions[g] = same
            # where the two ran the same steps, g is drawn as the best one: only where they decided apart can
            # one fall behind the other
            g_draws = np.where(np.isin(concurrencies, same), draws[best], draws[g])
            if ((g_draws / best_draws).min(axis=1) >= eff_draws[best]).mean() >= tie:
                tied.append(g)
        decision.within_noise = sorted(tied, key=lambda g: _threshold_key(g, levels))
        # Where speculation lost somewhere, the lowest threshold among the ties: the one that stops first as load
        # grows. Where it lost nowhere, the highest: it speculates furthest into the range that paid.
        decision.pick = decision.within_noise[-1 if decision.verdict == "no loss" else 0]
        if "auto" in eff_draws:
            # on the same draws, so the interval holds both envelopes' noise
            ratio_draws = eff_draws["auto"] / eff_draws[best]
            decision.auto_ratio = [decision.envelope["auto"][0] / decision.envelope[best][0],
                                   *(float(np.percentile(ratio_draws, q)) for q in INTERVAL)]
        if "sglang_adaptive" in eff_draws:  # SGLang's own adaptive speculation, swept beside
            for v in dict.fromkeys([best, "auto"] if "auto" in eff_draws else [best]):
                ratio_draws = eff_draws[v] / eff_draws["sglang_adaptive"]
                decision.versus_sglang[v] = [decision.envelope[v][0] / decision.envelope["sglang_adaptive"][0],
                                             *(float(np.percentile(ratio_draws, q)) for q in INTERVAL)]
    return decision
