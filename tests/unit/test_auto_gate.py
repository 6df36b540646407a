"""The auto gate against a simulated engine whose step costs follow a linear cost model."""

import random

import pytest

from specgate.gate import AutoConfig, AutoGate, Gate, GateConfig, bucket, make_gate

PLAIN = (0.010, 0.0010)  # seconds per step: a + b * batch
SPEC = (0.012, 0.0030)


def crossover(tau: float) -> float:
    """The batch at which tau * plain(b) = spec(b): speculation pays below it."""
    return (SPEC[0] - tau * PLAIN[0]) / (tau * PLAIN[1] - SPEC[1])


def drive(gate, steps, tau, rng, load):
    """Run `steps` decode steps at running batch sizes from `load`; return the thresholds seen."""
    seen = []
    for i in range(steps):
        b = load(i)
        spec = gate.decide(b)
        a, per = SPEC if spec else PLAIN
        noise = rng.uniform(0.95, 1.05)
        tokens = sum(1 + (rng.random() < (tau - 1) / 3) * 3 if spec else 1 for _ in range(b)) if spec else b
        gate.observe(b, spec, (a + per * b) * noise, tokens)
        seen.append(gate.threshold())
    return seen


def triangle(i, top=64, period=400):
    x = i % period
    return 1 + (top - 1) * (x if x < period // 2 else period - x) // (period // 2)


def test_the_threshold_follows_acceptance_the_way_the_cost_model_predicts():
    rng = random.Random(0)
    gate = AutoGate(AutoConfig(probe_every=100))
    drive(gate, 4000, tau=2.5, rng=rng, load=triangle)  # the cost model: pays up to ~26
    high = gate.threshold()
    assert crossover(2.5) == pytest.approx(26, abs=0.5)
    assert high in (16, 32), gate.counters()  # the bucket holding the crossover, or the one above
    seen = drive(gate, 4000, tau=1.5, rng=rng, load=triangle)  # the shift: pays only up to ~2
    low = gate.threshold()
    assert low < high and low in (1, 2, 4), gate.counters()  # within a bucket of the new crossover, 2
    # settled: from some step on, always within one bucket of the new crossover (2), never back near 26
    settled = next(i for i in range(len(seen)) if all(x is not None and x <= 4 for x in seen[i:]))
    assert settled < 2000, settled  # five load cycles: the spec side of each bucket is re-measured by probes


def test_probes_are_about_one_percent_of_steps_and_off_steps_follow_the_estimates():
    rng = random.Random(1)
    gate = AutoGate(AutoConfig(probe_every=200, probe_len=2))
    drive(gate, 6000, tau=2.5, rng=rng, load=lambda i: 48)  # one bucket, well above the crossover
    c = gate.counters()
    assert not c["gate_on"] and c["gains"][32] < 1
    assert c["probes"] * 2 / 6000 <= 0.011
    assert c["steps_on"] / 6000 < 0.02  # warm-up and probes only


def test_a_burst_far_above_the_crossover_is_predicted_and_switched_off_at_once():
    """Measured at batches 1-15 only, then a burst to 120 (tau 2: crossover 8, true gain 0.70 at 120):
    the line through the measured buckets predicts a gain far below 1 there, so the gate neither warms up
    the speculative side at 120 nor waits out its dwell; speculating, it stops on the burst's first step."""
    rng = random.Random(3)
    gate = AutoGate(AutoConfig(probe_every=100))
    drive(gate, 2000, tau=2.0, rng=rng, load=lambda i: triangle(i, top=15, period=100))
    assert gate.on and 6 not in gate.estimates and gate.gain(120) < 0.8
    before = gate.steps_on
    sides = []
    for _ in range(300):
        spec = gate.decide(120)
        sides.append(spec)
        a, per = SPEC if spec else PLAIN
        gate.observe(120, spec, a + per * 120, 240 if spec else 120)
    assert sides[0] is False and gate.steps_on - before <= 2 * gate.config.probe_len  # probes at most


def test_probes_lose_at_most_their_budget_of_the_time_where_speculation_costs_most():
    """At batch 100 (tau 1.5) a speculative step costs 2.8x a plain one and makes 1.5x the tokens: each
    probe step loses 0.147 s against a plain step's 0.11 s, so one probe every 50 steps would lose 5% of
    the time. Probes there are paid for by that bucket's own steps."""
    rng = random.Random(4)
    gate = AutoGate(AutoConfig(probe_every=50, probe_budget=0.01))
    drive(gate, 3000, tau=1.5, rng=rng, load=lambda i: triangle(i, top=15, period=100))  # cheap buckets first
    lost = total = 0.0
    for _ in range(20_000):
        spec = gate.decide(100)
        a, per = SPEC if spec else PLAIN
        t = a + per * 100
        gate.observe(100, spec, t, 150 if spec else 100)
        total += t
        lost += t - 1.5 * (PLAIN[0] + PLAIN[1] * 100) if spec else 0.0
    assert gate.probes >= 5  # the spec side is still re-measured
    assert lost / total <= 0.011


def test_hysteresis_and_dwell_stop_flapping_at_the_crossover():
    rng = random.Random(2)
    gate = AutoGate(AutoConfig(probe_every=10_000))
    # the batch hovers around the crossover inside one bucket (16-31): the gain is one number there
    drive(gate, 3000, tau=2.5, rng=rng, load=lambda i: rng.choice([24, 26, 28]))
    fixed = Gate(GateConfig(26))
    for _ in range(3000):
        fixed.decide(rng.choice([24, 26, 28]))
    assert gate.switches <= 4 and fixed.switches > 500


def test_seeds_replace_the_warm_up_and_bad_settings_name_the_key():
    seed = {b: {"plain_s": PLAIN[0] + PLAIN[1] * (1 << b), "spec_s": SPEC[0] + SPEC[1] * (1 << b), "tau": 2.5}
            for b in range(7)}  # fmt: skip
    gate = make_gate({"auto": {"seed": seed}})
    assert isinstance(gate, AutoGate) and gate.threshold() == 32  # gain < 1 from bucket 32-63 (crossover 26)
    assert gate.gain(1) > 1 and gate.gain(48) < 1  # known at once: no warm-up steps
    assert gate.decide(1) and gate.steps_on == 1
    assert isinstance(make_gate({"disable_at": 4}), Gate)
    for bad, key in [({"margin": 1.5}, "margin"), ({"probe_every": 0}, "probe_every"), ({"alpha": 0}, "alpha"),
                     ({"probe_len": 5, "probe_every": 5}, "probe_len"), ({"probe_budget": 1.0}, "probe_budget"),
                     ({"warm_band": -0.1}, "warm_band"), ({"outlier": 1.0}, "outlier")]:  # fmt: skip
        with pytest.raises(ValueError, match=key):
            AutoConfig(**bad)
    assert [bucket(b) for b in (1, 2, 3, 4, 7, 8, 64)] == [0, 1, 1, 2, 2, 3, 6]
    Gate(GateConfig(4)).observe(4, True, 0.1, 4)  # the fixed gate takes measurements and ignores them


def test_a_sweeps_cost_model_seeds_the_gate():
    from specgate.report.cost_model import CostModel, Line, auto_seed

    model = CostModel(Line(*PLAIN), Line(*SPEC), tau=2.5)
    seed = auto_seed(model, max_batch=64)
    assert sorted(seed) == list(range(7))
    gate = AutoGate(AutoConfig(seed=seed))
    assert gate.threshold() == 32 and model.crossover() == pytest.approx(crossover(2.5))


def test_a_stalled_step_or_a_lopsided_bucket_moves_the_estimate_a_bounded_amount():
    """A one-off stall (a compile, a host hiccup) counts as at most `outlier` times the estimate; a bucket
    whose samples sit at one batch but a few at the next gives no steeper line than a step with no fixed part."""
    gate = AutoGate(AutoConfig(warmup_steps=3))
    for _ in range(20):
        gate.observe_time(16, False, 0.010)
    gate.observe_time(16, False, 1.0)  # a 100x stall
    assert gate.seconds(16, "plain") < 0.012  # unclipped: ~0.085 (the stall's weight is alpha over the weights' sum)
    lopsided = AutoGate(AutoConfig(warmup_steps=3))
    for _ in range(40):
        lopsided.observe_time(16, True, 0.030)
    for _ in range(3):
        lopsided.observe_time(17, True, 0.060)  # 30 ms more for one request more: no step is like that
    # at most proportional to the batch: 35 ms (the weighted mean) x 24 / 16; the samples' own line gives ~0.27 s
    assert lopsided.seconds(24, "spec") < 0.053


def test_an_untimed_step_still_counts_as_the_first_on_its_side():
    """The engine reports a step that also caught the draft up without a time: the step after it on the
    same side is a typical one, and is measured."""
    gate = AutoGate(AutoConfig(warmup_steps=1))
    gate.observe_time(4, False, 0.010)
    gate.observe_time(4, False, 0.010)
    gate.observe_time(4, True, None)  # the switch's step, with its catch-up
    gate.observe_time(4, True, 0.030)
    assert gate.estimates[2]["spec"].n == 1 and gate.seconds(4, "spec") == pytest.approx(0.030)


def test_tau_is_the_mean_of_its_first_samples_then_an_ema():
    """A first speculative step that accepted nothing must not hold the estimate down for the hundreds of
    samples an EMA needs to forget it (the gate, off on that estimate, would gather few more)."""
    gate = AutoGate(AutoConfig())
    gate.observe_tokens(4, 4)  # 1 token per request
    for _ in range(20):
        gate.observe_tokens(4, 10)  # 2.5
    assert gate.tau == pytest.approx((4 + 200) / 84)  # an EMA alone: ~1.6
    for _ in range(3000):
        gate.observe_tokens(4, 6)  # the traffic shifts to 1.5: the EMA follows
    assert gate.tau == pytest.approx(1.5, abs=0.01)


def test_a_bucket_measured_at_one_batch_takes_its_slope_from_the_other_buckets():
    """The closed loop at c = 8 measures the 8-15 bucket at batch 8 only. A speculative step's time grows
    faster with the batch than a plain one's, so at 15 speculation can lose where it won at 8: read flat,
    the bucket would say it still wins there."""
    plain, spec, tau = (0.00475, 0.000064), (0.00555, 0.000413), 1.85  # gain 1.1 at 8, 0.9 at 15
    gate = AutoGate(AutoConfig(warmup_steps=3))
    gate.tau = tau
    for b in (4, 8, 16):
        for _ in range(5):
            gate.observe_time(b, False, plain[0] + plain[1] * b)
        gate.observe_time(b, True, None)  # the side's first step
        for _ in range(5):
            gate.observe_time(b, True, spec[0] + spec[1] * b)
        gate.observe_time(b, False, None)
    assert gate.gain(8) == pytest.approx(1.1, abs=0.01)
    assert gate.gain(15) == pytest.approx(0.9, abs=0.02)  # read flat: 1.1


def test_the_line_through_the_buckets_follows_a_new_bucket_at_once_and_its_samples_within_line_every():
    from specgate import gate as gate_module

    gate = AutoGate(AutoConfig(warmup_steps=3))
    for b in (4, 8):
        for _ in range(3):
            gate.observe_time(b, False, 0.010 + 0.001 * b)
    assert gate.seconds(64, "plain") == pytest.approx(0.010 + 0.001 * 64)  # predicted along the line
    for _ in range(3):  # a third bucket, off the line: the prediction moves with its third sample
        gate.observe_time(16, False, 0.040)
    moved = gate.seconds(64, "plain")
    assert moved > 0.080
    for _ in range(gate_module.LINE_EVERY):  # samples that move a bucket's mean: refitted within LINE_EVERY
        gate.observe_time(16, False, 0.026)
    assert gate.seconds(64, "plain") < moved


def _step(gate, b, tau, stall=0.0):
    """One decode step of the linear cost model; `stall` lengthens a speculative step."""
    spec = gate.decide(b)
    a, per = SPEC if spec else PLAIN
    gate.observe(b, spec, a + per * b + (stall if spec else 0.0), round(tau * b) if spec else b)
    return spec


def test_a_stalled_warm_up_step_does_not_hold_the_gate_off():
    """The H200 sweep whose auto gate never speculated, replayed: a warm-up burst at batch 127 measured both
    sides there (gain 0.63: off); the batch drained to 1 while off; one of the three speculative warm-up steps
    at batch 1 took ~30x its cost (a kernel's first compile). From the mean of the three the gain at batch 1
    read ~0.1, the line through the buckets carried that to every bucket, and no probe was ever affordable."""
    tau = 1.8  # gain ~0.63 at 127; at batch 1 a step yields round(1.8) = 2 tokens: gain 1.47
    gate = AutoGate()
    for _ in range(30):
        _step(gate, 127, tau)
    assert not gate.on
    for b in range(126, 0, -1):
        _step(gate, b, tau)
    spec_steps = 0
    for i in range(3000):
        stall = 0.5 if spec_steps == 1 else 0.0  # the first sampled speculative step at batch 1
        spec_steps += _step(gate, 1, tau, stall)
    assert gate.on and gate.gain(1) == pytest.approx(2 * 0.011 / 0.015, abs=0.02), gate.counters()  # 2 tokens a step at 1
    assert gate.steps_on >= 2900, gate.counters()


def test_an_estimate_far_off_is_probed_and_corrected_whatever_the_budget():
    """A speculative step estimated at 27x its cost predicts that a probe loses 0.76 s: at 1% of 11 ms
    steps the budget would cover it after ~7,000 steps. The probe floor runs one every probe_floor_every
    steps, and a step measured at under 1/outlier of its estimate restarts the estimate."""
    tau = 1.8
    seed = {0: {"plain_s": 0.011, "spec_s": 0.4, "tau": tau}}
    gate = AutoGate(AutoConfig(seed=seed))
    sides = [_step(gate, 1, tau) for _ in range(3000)]
    first_on = sides.index(True)
    assert first_on <= gate.config.probe_floor_every + 1 and all(sides[first_on + 2:]), gate.counters()
    assert gate.seconds(1, "spec") == pytest.approx(0.015)


def test_a_line_that_falls_with_the_batch_predicts_nothing():
    """Buckets measured at 2 and 64 whose speculative steps read 60 ms and 20 ms: one is wrong, and the
    gate measures a new bucket rather than trusting the line."""
    gate = AutoGate(AutoConfig(warmup_steps=1))
    for b, t in ((2, 0.060), (64, 0.020)):
        gate.observe_time(b, False, 0.01)
        gate.observe_time(b, True, None)
        gate.observe_time(b, True, t)
    assert gate.seconds(16, "spec") is None
    rising = AutoGate(AutoConfig(warmup_steps=1))
    for b, t in ((2, 0.020), (64, 0.060)):
        rising.observe_time(b, False, 0.01)
        rising.observe_time(b, True, None)
        rising.observe_time(b, True, t)
    assert rising.seconds(16, "spec") == pytest.approx(0.020 + 0.040 * 14 / 62, rel=0.05)
