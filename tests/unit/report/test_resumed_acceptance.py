"""The report's acceptance after the gate turns back on: pooled counts, against the rest and always-on."""

import pandas as pd

from specgate.report.report import _by_concurrency, resumed_section


def test_pooled_over_levels_and_divided_by_the_rest_and_by_always_on():
    summary = pd.DataFrame({
        "variant": ["always", "always", "gate_2", "gate_2", "nospec"],
        "accept_length": [2.0, 1.0, None, 1.9, None],
        "total_output_tokens": [300, 100, 100, 100, 100],  # always-on's τ: (2.0·300 + 1.0·100) / 400 = 1.75
        "spec_verify": [None, None, 0, 100, None],
        "spec_accepted": [None, None, 0, 190, None],
        "spec_verify_resumed": [None, None, 0, 40, None],
        "spec_accepted_resumed": [None, None, 0, 70, None],
    })  # fmt: skip
    lines = resumed_section(summary)
    rows = [ln for ln in "\n".join(lines).splitlines() if ln.startswith("| gate_2 |")]
    # after resuming 70 / 40 = 1.75; the other steps (190 - 70) / (100 - 40) = 2.0
    assert rows == ["| gate_2 | 40 | 1.750 | 2.000 | 0.875 | 1.000 |"]
    assert "τ = 1.750" in "\n".join(lines)


def test_no_section_without_steps_after_an_off_period():
    summary = pd.DataFrame({"variant": ["always", "gate_2"], "accept_length": [2.0, 2.0], "total_output_tokens": [1, 1],
                            "spec_verify": [None, 10], "spec_accepted": [None, 20],
                            "spec_verify_resumed": [None, 0], "spec_accepted_resumed": [None, 0]})  # fmt: skip
    assert resumed_section(summary) == []
    assert resumed_section(summary.drop(columns=["spec_verify_resumed"])) == []


def test_a_variant_without_any_value_is_a_column_of_dashes():
    """An auto gate that never speculated has no accept length at any level; the table still has its column."""
    summary = pd.DataFrame({"variant": ["always", "auto", "always", "auto"], "concurrency": [1, 1, 2, 2],
                            "accept_length": [1.9, None, 1.8, None]})  # fmt: skip
    table = _by_concurrency(summary, "accept_length", ["always", "auto"], 3)
    assert "| 1 | 1.900 | - |" in table and "| 2 | 1.800 | - |" in table
