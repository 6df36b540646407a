"""The auto gate in the reference engine: traffic switches from prompts the drafter predicts well
(counting) to prompts it cannot (random token ids), and the gate's threshold moves the way the cost
model says it must (lower acceptance: speculation stops paying at smaller batches)."""

import random
import threading

import pytest
from conftest import COUNT_RANGE, counting_prompt

from specgate.engine.reference import Engine, EngineConfig
from specgate.gate import AutoConfig

RUNNING = 6  # requests kept in flight: the 4-7 bucket


def keep_running(engine, make_prompt, steps):
    """Keep RUNNING requests in flight until the engine has taken `steps` more decode steps."""
    start, stop, lock = len(engine.steps), threading.Event(), threading.Lock()
    in_flight, errors = [0], []

    def on_done(reason, error):
        if error:
            errors.append(error)
        with lock:
            in_flight[0] -= 1

    while len(engine.steps) - start < steps:
        with lock:
            room = RUNNING - in_flight[0]
            in_flight[0] += room
        for _ in range(room):
            engine.submit(make_prompt(), 24, True, lambda toks: None, on_done)
        stop.wait(0.005)
    while in_flight[0]:
        stop.wait(0.01)
    assert not errors


@pytest.fixture(scope="module")
def engine(counting_target, tiny_drafter):
    e = Engine(EngineConfig(str(counting_target), str(tiny_drafter), num_steps=3, max_running=8, max_len=256,
                            # tau over 16 steps of 6 requests: the shift is followed within the 300 steps
                            gate=AutoConfig(probe_every=40, min_dwell_steps=4, tau_memory=96)))  # fmt: skip
    yield e
    e.shutdown()


def test_the_threshold_moves_down_when_acceptance_falls(engine):
    rng = random.Random(0)
    keep_running(engine, lambda: counting_prompt(rng.randrange(COUNT_RANGE)), steps=300)
    gate = engine.gate
    tau_high, before, g_before = gate.tau, gate.counters(), gate.gain(4)
    # the same engine, now random token ids far above the counted range: the drafter's guesses fail
    shift = len(engine.steps)
    keep_running(engine, lambda: [rng.randrange(COUNT_RANGE, 40000) for _ in range(6)], steps=300)
    after, g_after = gate.counters(), gate.gain(4)
    assert gate.tau < tau_high - 0.5  # acceptance fell (tokens per request per speculative step)
    assert g_after < g_before * 0.8, (before, after)  # the model's gain follows tau
    t = lambda c: float("inf") if c["auto_threshold"] is None else c["auto_threshold"]  # noqa: E731
    assert t(after) <= t(before) and t(after) <= 4  # the direction the cost model gives; off in this bucket
    # settled within the 300 steps: at batch 4-7, speculative steps in the last 80 are down to about the
    # probes (at most 4 every 40 steps), against all of them before the shift; smaller batches decide apart
    modes = [m for m, b, *_ in list(engine.steps)[shift:] if b >= 4]
    assert modes[-80:].count("spec") <= 10, modes[-80:].count("spec")
