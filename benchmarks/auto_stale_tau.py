"""The auto gate after acceptance rises while it is off: a model check on the embedded default's step costs.

What a sweep on the CPU can do to the gate: its first requests at c = 1 accept little (tau near 1.1), the gate
turns speculation off, and then the requests accept more (tau 1.35-1.45), where speculation pays at batch 1 to
about 8. While off, tau is seen only through probes: a few speculative steps every `probe_every` steps or more,
each a handful of request-steps in an estimate that remembers `tau_memory` of them. This prints, per phase, the
share of decode steps the gate speculated, beside the true gain at that batch.

    python benchmarks/auto_stale_tau.py --seeds 8

Step costs are the embedded default's (reference engine, 2-vCPU VM): plain 77.5 + 1.6 ms per request,
speculative 86.0 + 5.5 ms per request; a speculative step gives each request 1 + Binomial(3, (tau - 1) / 3)
tokens; step times carry a uniform +-5% noise.
"""

from __future__ import annotations

import argparse
import random
import statistics

from common import emit

from specgate.gate import AutoGate

PLAIN, SPEC = (0.0775, 0.0016), (0.0860, 0.0055)
PRIME = range(8, 0, -1)  # the sweep's priming wave at max_running 8, tau as the traffic's later
PHASES = [(1, 1.08, 220), (1, 1.35, 160), (2, 1.40, 250), (4, 1.45, 250), (8, 1.45, 250)]  # batch, tau, steps


def step(gate: AutoGate, rng: random.Random, b: int, tau: float) -> bool:
    spec = gate.decide(b)
    a, c = SPEC if spec else PLAIN
    gate.observe_time(b, spec, (a + c * b) * rng.uniform(0.95, 1.05))
    if spec:
        q = (tau - 1) / 3
        gate.observe_tokens(b, sum(1 + sum(rng.random() < q for _ in range(3)) for _ in range(b)))
    return spec


def run(seed: int) -> list[float]:
    rng, gate = random.Random(seed), AutoGate()
    for b in PRIME:
        step(gate, rng, b, 1.35)
    return [sum(step(gate, rng, b, tau) for _ in range(n)) / n for b, tau, n in PHASES]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--out", help="also write the table here")
    args = p.parse_args(argv)
    shares = [run(s) for s in range(args.seeds)]
    rows = ["| batch | tau | steps | true gain | share speculated, median [range] over seeds |", "|---|---|---|---|---|"]
    for i, (b, tau, n) in enumerate(PHASES):
        gain = tau * (PLAIN[0] + PLAIN[1] * b) / (SPEC[0] + SPEC[1] * b)
        col = [s[i] for s in shares]
        rows.append(f"| {b} | {tau:.2f} | {n} | {gain:.3f} | {statistics.median(col):.2f} [{min(col):.2f}–{max(col):.2f}] |")
    emit("\n".join(rows), args.out)


if __name__ == "__main__":
    main()
