import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specgate.gate import Gate, GateConfig


@st.composite
def configs(draw):
    disable_at = draw(st.integers(1, 64))
    enable_at = draw(st.one_of(st.none(), st.integers(0, disable_at - 1)))
    return GateConfig(disable_at, enable_at, draw(st.integers(0, 8)))


loads = st.lists(st.integers(0, 96), min_size=1, max_size=300)


@settings(max_examples=300, deadline=None)
@given(configs(), loads)
def test_at_most_one_switch_per_dwell_window(cfg, trace):
    gate = Gate(cfg)
    states = [gate.decide(n) for n in trace]
    switch_steps = [i for i in range(1, len(states)) if states[i] != states[i - 1]]
    if not states[0]:
        switch_steps.insert(0, 0)  # switched off at the very first step
    for a, b in zip(switch_steps, switch_steps[1:]):
        assert b - a >= max(cfg.min_dwell_steps, 1)
    assert gate.switches == len(switch_steps)
    assert gate.steps_on + gate.steps_off == len(trace) and gate.steps_on == sum(states)


@settings(max_examples=300, deadline=None)
@given(configs(), loads)
def test_never_off_below_enable_or_on_at_disable_once_dwell_allows(cfg, trace):
    gate = Gate(cfg)
    for n in trace:
        dwell_ok = gate._dwell >= cfg.min_dwell_steps
        on = gate.decide(n)
        if dwell_ok and n <= cfg.enable_at:
            assert on
        if dwell_ok and n >= cfg.disable_at:
            assert not on


def test_hysteresis_band_keeps_state():
    gate = Gate(GateConfig(disable_at=8, enable_at=4))
    assert [gate.decide(n) for n in [1, 8, 6, 5, 4, 6, 7, 8]] == [True, False, False, False, True, True, True, False]
    assert gate.counters()["switches"] == 3


def test_no_threshold_always_speculates():
    gate = Gate(GateConfig(None))
    assert all(gate.decide(n) for n in range(200))


@pytest.mark.parametrize("kwargs", [{"disable_at": 0}, {"disable_at": 4, "enable_at": 4}, {"disable_at": 4, "min_dwell_steps": -1}])
def test_bad_settings_are_rejected(kwargs):
    with pytest.raises(ValueError, match="gate"):
        GateConfig(**kwargs)


def test_a_gate_whose_threshold_is_lifted_while_off_speculates_again():
    # the auto gate lifts its threshold (disable_at None) where speculation pays at every batch; a gate that was
    # off then has no threshold to resume at and must turn on by itself
    gate = Gate(GateConfig(disable_at=4, enable_at=2, min_dwell_steps=0))
    assert gate.decide(1) and not gate.decide(8)
    gate.config.disable_at, gate.config.enable_at = None, None
    assert gate.decide(8) and gate.decide(64) and gate.switches == 2
