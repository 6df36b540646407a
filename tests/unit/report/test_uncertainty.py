"""The decision rule on synthetic sweeps whose truth is known: per-round throughputs and per-request
records drawn around chosen level throughputs, with chosen noise."""

import numpy as np
import pandas as pd
import pytest

from specgate.report import uncertainty as un

LEVELS = (1, 2, 4, 8)


def synthetic(truth: dict[str, list[float]], noise: float | list[float], rounds: int = 3, requests: int = 12, seed: int = 0,
              turn_noise: float = 0.0, shares: dict[str, list[float]] | None = None):
    """(rounds, records) as the bench jobs write them: truth[variant][i] is the throughput at LEVELS[i].
    `turn_noise` is what a turn does to every variant alike beside its no-spec block (that block's own
    noise, the turn's acceptance): one factor per level and round, shared by all but no-spec. `shares`
    gives a gate's share of decode steps speculated at each level, as the servers count them. A list of
    noises gives each level its own."""
    rng = np.random.default_rng(seed)
    noises = list(noise) if isinstance(noise, list) else [noise] * len(LEVELS)
    turn = 1 + turn_noise * rng.standard_normal((len(LEVELS), rounds))
    rows, records = [], []
    for v, thr in truth.items():
        disable_at = int(v.split("_")[1]) if v.startswith("gate_") else np.nan
        for i, (c, t) in enumerate(zip(LEVELS, thr, strict=True)):
            noise = noises[i]
            for r in range(rounds):
                measured = t * (1 + noise * rng.standard_normal()) * (1 if v == "nospec" else turn[i, r])
                rows.append({"variant": v, "concurrency": c, "round": r, "output_throughput": measured, "completed": requests,
                             "failed": 0, "total_output_tokens": 48 * requests, "duration": 48 * requests / measured,
                             "engine": "reference", "server_version": "x", "disable_at": disable_at, "enable_at": np.nan,
                             "accept_length": 1.5, "accept_length_source": "s", "errors": np.nan})  # fmt: skip
                if shares and v in shares:
                    rows[-1].update(gate_steps_on=round(100 * shares[v][i]), gate_steps_off=round(100 * (1 - shares[v][i])))
                # per-request rates around the round's, so Little's law gives back about `measured`
                for _ in range(requests):
                    rate = measured / c * (1 + noise * rng.standard_normal())
                    records.append({"variant": v, "concurrency": c, "round": r, "output_tokens": 48,
                                    "e2e_s": 48 / max(rate, 1e-3), "error": None})  # fmt: skip
    return pd.DataFrame(rows), pd.DataFrame(records)


def decide(truth, noise, **kw):
    rounds, records = synthetic(truth, noise, **kw)
    boot = un.bootstrap_levels(rounds, records)
    levels = un.intervals(un.aggregate_rounds(rounds), boot)
    return un.decide(levels, boot), levels


NOSPEC = [100.0, 180.0, 300.0, 400.0]
ALWAYS = [150.0, 230.0, 260.0, 240.0]  # pays at 1 and 2, loses at 4 and 8


def test_a_clear_winner_is_picked_alone():
    # gate_4 follows always-on below 4 and no-spec from 4: the envelope. gate_2 gives up c = 2, gate_8 c = 4 and 8.
    truth = {"nospec": NOSPEC, "always": ALWAYS, "gate_2": [150, 180, 300, 400], "gate_4": [150, 230, 300, 400],
             "gate_8": [150, 230, 260, 240]}  # fmt: skip
    d, levels = decide(truth, noise=0.01)
    assert d.verdict == "gate" and d.pays == [1, 2] and d.loses == [4, 8]
    assert d.best == d.pick == "gate_4" and d.within_noise == ["gate_4"]
    point, lo, hi = d.envelope["gate_4"]
    assert lo <= point <= hi and point > 0.97 and hi - lo < 0.1
    assert (levels.output_throughput_lo <= levels.output_throughput).all()
    assert (levels.output_throughput <= levels.output_throughput_hi).all()


def test_gates_within_noise_are_named_and_the_lowest_threshold_is_picked():
    # gate_4 and gate_8 measure the same truth under 3% noise: a tie, resolved to the lower threshold
    # whichever of the two measured higher. gate_2 loses 22% at c = 2: not within noise. The rule holds a
    # tie to 10% of draws, so about one sweep in ten separates a true tie: over 20 sweeps, 15 or more
    # name it (fewer happens with probability about 1% at 90%).
    truth = {"nospec": NOSPEC, "always": ALWAYS, "gate_2": [150, 180, 300, 400], "gate_4": [150, 230, 300, 400],
             "gate_8": [150, 230, 300, 400]}  # fmt: skip
    named = []
    for seed in range(20):
        d, _ = decide(truth, noise=0.03, seed=seed)
        assert "gate_2" not in d.within_noise and d.envelope["gate_2"][2] < d.envelope[d.best][1], (seed, d.envelope)
        if d.within_noise == ["gate_4", "gate_8"]:
            named.append((d.best, d.pick))
    assert len(named) >= 15
    assert {best for best, _ in named} == {"gate_4", "gate_8"}  # the better-measured one changes with the noise...
    assert {pick for _, pick in named} == {"gate_4"}  # ...the recommendation does not


def test_what_a_turn_does_to_every_variant_alike_does_not_hide_a_difference_between_them():
    # Each turn moves every variant together by 10% (its no-spec block's noise, its acceptance), far
    # more than the 1% that separates one variant from another within a turn. gate_4 gives up 10% at
    # c = 2 in every turn: drawn a turn at a time, the comparison sees the 10% and not the turn's noise.
    # (Drawn a cell at a time, the two are within noise.)
    # Each level's noise is sized from its own 3 turns, so in a sweep where one level's turns happen to spread
    # far, both gates' envelopes can fall to that level, where they ran the same: one seed in ten may tie them.
    truth = {"nospec": NOSPEC, "always": ALWAYS, "gate_4": [150, 207, 360, 480], "gate_8": [150, 230, 360, 480]}
    picks = [decide(truth, noise=0.01, turn_noise=0.10, seed=seed)[0] for seed in range(10)]
    assert all(d.best == "gate_8" for d in picks)
    assert sum(d.pick == "gate_8" and d.within_noise == ["gate_8"] for d in picks) >= 9, [d.within_noise for d in picks]


def test_gates_are_compared_only_where_they_decided_apart():
    # gate_4 and gate_8 speculate at 1 and 2 and stop at 8; only at 4 do they decide apart, where speculation
    # breaks even. At 8 both ran plain steps, yet gate_4's blocks there read 15% low: a difference between two
    # servers running the same steps, the measurement's own. Compared only where they decided apart, the two
    # are within noise, and the lower threshold is picked; without the counters the 15% decides.
    always = [150.0, 230.0, 300.0, 240.0]
    truth = {"nospec": NOSPEC, "always": always, "gate_4": [150, 230, 300, 340], "gate_8": [150, 230, 300, 400]}
    shares = {"gate_4": [1, 1, 0, 0], "gate_8": [1, 1, 1, 0]}
    for seed in range(5):
        d, _ = decide(truth, noise=0.01, seed=seed, shares=shares)
        assert d.best == "gate_8" and d.within_noise == ["gate_4", "gate_8"] and d.pick == "gate_4", (seed, d.envelope)
        assert d.same_decisions["gate_4"] == [1, 2, 8]
        d, _ = decide(truth, noise=0.01, seed=seed)
        assert d.within_noise == ["gate_8"] and d.pick == "gate_8", (seed, d.envelope)
    # where they decided apart, a gate that fell behind is still behind
    truth["gate_4"] = [150, 230, 250, 340]
    d, _ = decide(truth, noise=0.01, shares=shares)
    assert d.within_noise == ["gate_8"] and d.pick == "gate_8", d.envelope


def test_a_quiet_level_keeps_its_gain_beside_loud_ones():
    # every block at c = 1 shows +12% within 1%; c = 4 and 8 move by 20% from block to block. One noise size for
    # every level would bury c = 1's gain in c = 8's spread.
    truth = {"nospec": NOSPEC, "always": [112, 190, 300, 300], "gate_4": [112, 190, 300, 400]}
    for seed in range(3):
        d, _ = decide(truth, noise=[0.01, 0.01, 0.2, 0.2], seed=seed)
        assert d.pays[:1] == [1], (seed, d.pays)


def test_always_on_never_paying_says_serve_without_speculation():
    truth = {"nospec": NOSPEC, "always": [70, 120, 150, 160], "gate_2": [70, 180, 300, 400]}
    d, _ = decide(truth, noise=0.02)
    assert d.verdict == "no speculation" and d.pays == [] and d.loses == list(LEVELS)
    assert d.pick == "gate_2"


def test_speculation_within_noise_of_no_spec_is_break_even():
    # each of 4 levels may pay by chance in 5% / 4 of sweeps: over 20 sweeps, 15 or more are break-even
    truth = {"nospec": NOSPEC, "always": [101, 181, 299, 401], "gate_2": [101, 180, 300, 400]}
    verdicts = [decide(truth, noise=0.05, seed=seed)[0].verdict for seed in range(20)]
    assert verdicts.count("break-even") >= 15


@pytest.mark.parametrize("noise", [0.01, 0.1])
def test_the_interval_widens_with_the_noise_and_holds_the_truth(noise):
    truth = {"nospec": NOSPEC, "always": ALWAYS}
    _, levels = decide(truth, noise=noise, rounds=5, seed=3)
    width = ((levels.output_throughput_hi - levels.output_throughput_lo) / levels.output_throughput).mean()
    assert (0.002 if noise == 0.01 else 0.05) < width < (0.05 if noise == 0.01 else 0.5)
    t = levels.set_index(["variant", "concurrency"])
    held = sum(t.at[(v, c), "output_throughput_lo"] <= x <= t.at[(v, c), "output_throughput_hi"]
               for v, xs in truth.items() for c, x in zip(LEVELS, xs, strict=True))  # fmt: skip
    assert held >= 6  # of 8 levels: a 90% interval of the median of 5 rounds


def test_the_auto_variant_is_reported_beside_the_fixed_thresholds_and_never_picked():
    from specgate.report.report import auto_gate_section

    truth = {"nospec": NOSPEC, "always": ALWAYS, "gate_2": [150, 228, 300, 398], "gate_4": [150, 230, 262, 396],
             "auto": [149, 226, 296, 392]}  # fmt: skip
    rounds, records = synthetic(truth, 0.01)
    rounds["auto_threshold"] = np.where(rounds.variant == "auto", 4.0, np.nan)
    is_auto = rounds.variant == "auto"
    # gate_2 speculates on the same share of steps as auto at every level but the first
    best_on = np.where(rounds.concurrency == 1, 20.0, 30.0)
    rounds["gate_steps_on"] = np.where(is_auto, 30.0, np.where(rounds.variant == "gate_2", best_on, np.nan))
    rounds["gate_steps_off"] = np.where(is_auto, 10.0, np.where(rounds.variant == "gate_2", 40.0 - best_on, np.nan))
    rounds["gate_probes"] = np.where(is_auto, 1.0, np.nan)
    rounds["gate_switches"] = np.where(is_auto, 2.0, np.nan)  # no flushes: a server that does not report them
    boot = un.bootstrap_levels(rounds, records)
    levels = un.intervals(un.aggregate_rounds(rounds), boot)
    decision = un.decide(levels, boot)
    assert decision.pick == "gate_2" and "auto" in decision.envelope
    text = auto_gate_section(levels, decision)
    assert "| 1 | 4 |" in text and "÷ gate_2" in text
    rounds_n = int(rounds["round"].nunique())  # counts are summed over rounds
    row = next(line for line in text.splitlines() if line.startswith("| 1 | 4 |")).split(" | ")
    both = f"{30 * rounds_n} of {40 * rounds_n}"
    assert row[4:] == [both, f"{20 * rounds_n} of {40 * rounds_n}", str(2 * rounds_n), str(rounds_n), "- |"]
    ratio = float(text.split("ratio **")[1].split("**")[0])
    assert ratio == pytest.approx(decision.envelope["auto"][0] / decision.envelope["gate_2"][0], abs=1e-3)
    assert 0.97 < ratio < 1.0
    point, lo, hi = decision.auto_ratio
    assert point == pytest.approx(ratio, abs=1e-3) and lo < point < hi and hi - lo < 0.05
    assert f"[90% interval {lo:.3f}–{hi:.3f}]" in text
    # the levels where both speculated alike give the spread of servers run one after another
    t = levels.pivot_table(index="concurrency", columns="variant", values="output_throughput")
    alike = (t.auto / t.gate_2).loc[list(LEVELS[1:])]
    assert f"At concurrency {', '.join(map(str, LEVELS[1:]))} auto speculated" in text
    assert f"ran {alike.min():.3f}–{alike.max():.3f}" in text


def test_one_slow_round_leaves_the_median_inside_its_interval():
    # as the embedded sweep saw: one round of a variant ~25% slow at every level (a noisy neighbour)
    rounds, records = synthetic({"nospec": NOSPEC, "always": ALWAYS, "auto": NOSPEC}, noise=0.03, seed=5)
    slow = (rounds.variant == "auto") & (rounds["round"] == 1)
    rounds.loc[slow, "output_throughput"] *= 0.75
    levels = un.intervals(un.aggregate_rounds(rounds), un.bootstrap_levels(rounds, records))
    assert (levels.output_throughput_lo <= levels.output_throughput).all()
    assert (levels.output_throughput <= levels.output_throughput_hi).all()


def test_the_rationale_names_a_gain_above_the_lowest_level():
    # always-on level with no-spec at c = 1 and ahead at c = 2: the report must not say it never beat no-spec
    from specgate.report import cost_model as cm
    from specgate.report.report import rationale

    truth = {"nospec": NOSPEC, "always": [99, 230, 290, 380], "gate_2": [99, 180, 300, 400],
             "gate_4": [99, 230, 300, 400]}  # fmt: skip
    d, levels = decide(truth, noise=0.01)
    text = rationale(levels, d, cm.fit(levels)[0])
    t = levels.pivot_table(index="concurrency", columns="variant", values="output_throughput")
    gain = t.always / t.nospec
    assert gain[1] < 1 < gain[2] and "never beat" not in text
    assert f"×{gain[1]:.2f} no-spec at concurrency 1, ×{gain[2]:.2f} at 2 and ×{gain[8]:.2f} at 8" in text


def test_the_switched_sweeps_no_spec_keeps_the_spread_of_its_own_blocks():
    # In the switched design every ratio's denominator is the turn's no-spec block, so no-spec's ratios are
    # all 1 and carry no spread; its interval comes from its own blocks' measured throughput.
    rng = np.random.default_rng(1)
    rows = []
    for c, base in zip(LEVELS, NOSPEC, strict=True):
        for turn in range(5):
            nospec = base * (1 + 0.05 * rng.standard_normal())
            for v, gain in (("nospec", 1.0), ("always", 1.2)):
                measured = nospec * gain * (1 + 0.02 * rng.standard_normal()) if v == "always" else nospec
                rows.append({"variant": v, "concurrency": c, "round": 0, "block": turn, "output_throughput": measured,
                             "ratio": measured / nospec, "baseline_output_throughput": nospec, "completed": 10,
                             "failed": 0, "errors": np.nan})  # fmt: skip
    rounds = un.replicates(pd.DataFrame(rows))
    boot = un.bootstrap_levels(rounds, pd.DataFrame(columns=["variant", "concurrency", "round", "output_tokens", "e2e_s", "error"]))
    levels = un.intervals(un.aggregate_rounds(rounds), boot, rounds).set_index(["variant", "concurrency"])
    for c in LEVELS:
        own = rounds[(rounds.variant == "nospec") & (rounds.concurrency == c)].measured_throughput
        lo, mid, hi = levels.loc[("nospec", c), ["output_throughput_lo", "output_throughput", "output_throughput_hi"]]
        assert lo < mid < hi and own.min() <= lo and hi <= own.max()


def test_a_sweep_that_never_reaches_the_loss_picks_the_highest_tied_threshold():
    # always-on pays at 1 and 2 and ties no-spec at 4 and 8: nothing swept lost, so the sweep stopped below the
    # crossover, and among tied gates the one that speculates furthest is picked, with a line saying so
    from specgate.report import cost_model as cm
    from specgate.report.report import rationale

    truth = {"nospec": NOSPEC, "always": [150, 230, 300, 400], "gate_2": [150, 200, 300, 400],
             "gate_4": [150, 230, 300, 400], "gate_8": [150, 230, 300, 400]}  # fmt: skip
    d, levels = decide(truth, noise=0.01)
    assert d.verdict == "no loss" and d.pays == [1, 2] and d.loses == []
    assert d.within_noise == ["gate_4", "gate_8"] and d.pick == "gate_8"
    text = rationale(levels, d, cm.fit(levels)[0])
    assert "paid beyond noise at c = 1, 2 and lost at no measured load, up to concurrency 8: gate it at 8" in text
    assert "picks the highest threshold" in text


def test_blocks_that_never_deviate_draw_no_noise():
    # every block of every cell the same: no level has a spread to draw from, and the draws are the cells
    rounds = pd.DataFrame([{"variant": v, "concurrency": c, "round": r, "output_throughput": 100.0 * c}
                           for c in (1, 2) for r in range(3) for v in ("nospec", "always")])  # fmt: skip
    empty = pd.DataFrame(columns=["variant", "concurrency", "round", "output_tokens", "e2e_s", "error"])
    boot = un.bootstrap_levels(rounds, empty)
    assert {k: (float(v.min()), float(v.max())) for k, v in boot.items()} == {
        (v, c): (100.0 * c, 100.0 * c) for c in (1, 2) for v in ("nospec", "always")}


def test_the_best_gate_and_auto_are_compared_with_sglangs_own_adaptive_speculation():
    from specgate.report.report import sglang_adaptive_section

    # SGLang's adaptive tiers keep most of always-on's gain at 1 and 2 but run the verify path at 0 steps above:
    # well below no-spec at 4 and 8. gate_4 is the envelope; auto a little below it.
    truth = {"nospec": NOSPEC, "always": ALWAYS, "gate_4": [150, 230, 300, 400], "auto": [148, 226, 296, 395],
             "sglang_adaptive": [146, 222, 250, 300]}  # fmt: skip
    d, _ = decide(truth, noise=0.01)
    assert d.pick == "gate_4" and "sglang_adaptive" not in d.within_noise  # never a gate to pick
    assert set(d.versus_sglang) == {"gate_4", "auto"}
    point, lo, hi = d.versus_sglang["gate_4"]
    assert point == pytest.approx(d.envelope["gate_4"][0] / d.envelope["sglang_adaptive"][0]) and 1 < lo < point < hi
    assert point == pytest.approx(1 / 0.75, abs=0.04)  # 300 / 400 at c = 8, the adaptive server's worst level
    text = sglang_adaptive_section(d)
    assert f"| gate_4 | {d.envelope['gate_4'][0]:.3f}" in text and f"**{point:.3f}**" in text and "beyond noise" in text
    # the same server, adaptive within noise of the gate: no claim beyond it
    truth["sglang_adaptive"] = truth["gate_4"]
    d, _ = decide(truth, noise=0.03)
    assert "within noise" in sglang_adaptive_section(d).split("| gate_4 |")[1].splitlines()[0]
