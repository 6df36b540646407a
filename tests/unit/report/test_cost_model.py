"""Cost model: recovers known step-time lines, predicts the crossover, and scores envelopes."""

import math

import numpy as np
import pandas as pd
import pytest

from specgate.report import cost_model as cm


def synthetic_sweep(plain: cm.Line, spec: cm.Line, tau: float, levels=(1, 2, 4, 8, 16, 32), thresholds=(2, 8)):
    rows = []
    model = cm.CostModel(plain, spec, tau)
    for c in levels:
        rows.append({"variant": "nospec", "concurrency": c, "output_throughput": float(model.nospec_throughput(c)),
                     "accept_length": np.nan, "total_output_tokens": 100})  # fmt: skip
        rows.append({"variant": "always", "concurrency": c, "output_throughput": float(model.spec_throughput(c)),
                     "accept_length": tau, "total_output_tokens": 100})  # fmt: skip
        for t in thresholds:
            rows.append({"variant": f"gate_{t}", "concurrency": c,
                         "output_throughput": float(model.gated_throughput(c, t)), "accept_length": tau,
                         "total_output_tokens": 100})  # fmt: skip
    return pd.DataFrame(rows)


def test_fit_recovers_the_lines_and_tau():
    plain, spec = cm.Line(0.010, 0.0005), cm.Line(0.012, 0.0030)
    model, steps = cm.fit(synthetic_sweep(plain, spec, 2.0))
    assert model.tau == pytest.approx(2.0)
    assert model.plain.fixed == pytest.approx(plain.fixed) and model.plain.per_request == pytest.approx(plain.per_request)
    assert model.spec.fixed == pytest.approx(spec.fixed) and model.spec.per_request == pytest.approx(spec.per_request)
    assert set(steps.variant) == {"nospec", "always"}


def test_crossover_is_where_speculation_stops_paying():
    model = cm.CostModel(cm.Line(0.010, 0.0005), cm.Line(0.012, 0.0030), 2.0)
    b = model.crossover()
    # τ·t_plain(b) == t_spec(b) at the crossover
    assert 2.0 * model.plain(b) == pytest.approx(model.spec(b))
    assert b == pytest.approx((2.0 * 0.010 - 0.012) / (0.0030 - 2.0 * 0.0005))  # = 4.0
    assert model.threshold() == 5
    assert model.spec_throughput(3) > model.nospec_throughput(3) and model.spec_throughput(6) < model.nospec_throughput(6)


def test_crossover_extremes():
    assert model_with(tau=1.0, spec_fixed=0.02).crossover() == 0.0  # speculation never pays
    assert math.isinf(model_with(tau=3.0, spec_fixed=0.011, spec_slope=0.001).crossover())  # always pays


def model_with(tau, spec_fixed, spec_slope=0.003):
    return cm.CostModel(cm.Line(0.010, 0.0005), cm.Line(spec_fixed, spec_slope), tau)


def test_envelope_efficiency_and_measured_crossover():
    summary = synthetic_sweep(cm.Line(0.010, 0.0005), cm.Line(0.012, 0.0030), 2.0)
    eff = cm.envelope_efficiency(summary).set_index("variant")
    assert eff.at["nospec", "envelope_efficiency"] < 1 and eff.at["always", "envelope_efficiency"] < 1
    # gate_8 speculates at 1, 2, 4 (below the crossover at 4.0, or tied) and not at 8+: on the envelope everywhere
    assert eff.at["gate_8", "envelope_efficiency"] == pytest.approx(1.0)
    # gate_2 stops at 2, where speculation still wins
    assert eff.at["gate_2", "envelope_efficiency"] < 0.95 and eff.at["gate_2", "worst_concurrency"] == 2
    assert cm.measured_crossover(summary) == pytest.approx(4.0)
    model, _ = cm.fit(summary)
    assert cm.predicted_envelope(model, [1, 2, 4, 8, 16, 32], 5) == pytest.approx(1.0)


def test_gate_off_comparison_pairs_true_off_with_steps0():
    import pandas as pd

    from specgate.report.report import gate_off_comparison

    rows = [("nospec", c, 100.0 * c) for c in (1, 4, 16)] + [("gate_4", c, 95.0 * c) for c in (1, 4, 16)]
    summary = pd.DataFrame(rows, columns=["variant", "concurrency", "output_throughput"])
    assert gate_off_comparison(summary) is None  # no steps0_T to compare with
    rows += [("steps0_4", c, 50.0 * c) for c in (1, 4, 16)] + [("steps0_8", c, 10.0) for c in (1, 4, 16)]
    table = gate_off_comparison(pd.DataFrame(rows, columns=["variant", "concurrency", "output_throughput"]))
    assert table.splitlines()[2:] == ["| 4 | 16 | 1600.0 | 0.950 | 0.500 |"]  # c ≥ 2T only; steps0_8 has no gate_8


def test_a_few_percent_of_noise_at_the_largest_batches_leaves_the_fixed_cost():
    """Relative residuals: ±5% at batches 64 and 128 moves the fixed cost by under 1%; plain least
    squares, where the longest steps dominate, moved it by 4% on these points."""
    batch = np.array([1, 2, 4, 8, 16, 32, 64, 128.0])
    seconds = (0.005 + 0.0002 * batch) * np.array([1, 1, 1, 1, 1, 1, 1.05, 0.95])
    line = cm.fit_line(batch, seconds)
    assert line.fixed == pytest.approx(0.005, rel=0.01)
    assert abs(np.polyfit(batch, seconds, 1)[1] / 0.005 - 1) > 0.03


def test_the_report_places_the_crossover_by_the_noise_aware_verdict_not_by_medians():
    from specgate.report.report import measured_crossing
    from specgate.report.uncertainty import Decision

    # a median dipping below 1 at the lowest level, within noise, is no crossover
    assert measured_crossing(Decision("no loss", "gate_4", "gate_4", ["gate_4"], pays=[4]), [1, 2, 4, 8]) == "> 8 (lost at no level beyond noise)"
    assert measured_crossing(Decision("gate", "gate_8", "gate_8", ["gate_8"], pays=[1, 2], loses=[16, 32]), [1, 2, 4, 8, 16, 32]) == "8–16"
    assert measured_crossing(Decision("no speculation", None, None, [], loses=[1, 2]), [1, 2]) == "≤ 1"
