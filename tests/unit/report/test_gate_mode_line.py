"""The report names the gate mode each gated variant ran and, on SGLang, the true-off adapter."""

import pandas as pd

from specgate.report.report import gate_mode_line


def test_the_report_names_the_mode_and_the_adapter_that_ran():
    summary = pd.DataFrame({"variant": ["nospec", "gate_4", "gate_8", "steps0_8"],
                            "gate_mode": [None, "true-off", "true-off", "sglang-steps0"],
                            "gate_adapter": [None, "SGLang 0.5.17", "SGLang 0.5.17", None]})  # fmt: skip
    line = gate_mode_line(summary)[1]
    assert line.startswith("Gate mode that ran: sglang-steps0 (steps0_8); true-off through the SGLang 0.5.17 adapter "
                           "(gate_4, gate_8). `sglang-steps0` is SGLang's own")  # fmt: skip
    reference = summary.drop(columns="gate_adapter").iloc[:3]  # the reference engine: no adapter, no fallback
    assert gate_mode_line(reference) == ["", "Gate mode that ran: true-off (gate_4, gate_8)."]
    assert gate_mode_line(summary.assign(gate_mode=None)) == []
