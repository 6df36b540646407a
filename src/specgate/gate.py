"""The load gate: speculate while the running decode batch is small, stop above a threshold.

Pure policy, no torch and no sglang: the reference engine and the SGLang plugin share it.
Per decode step it sees the number of running decode requests (prefills do not count) and
answers whether this step drafts.

    on  -> off   when running >= disable_at
    off -> on    when running <= enable_at   (enable_at defaults to disable_at - 1)
    a switch is allowed only after min_dwell_steps steps in the current state

Hysteresis (enable_at < disable_at - 1) and the dwell keep the gate from flapping when
the load hovers at the threshold.

`AutoGate` below has no threshold: it measures step costs and acceptance and speculates where that
pays (docs/design/auto-gate.md). Both answer `decide(running)`, and take each step's time (`observe_time`) and a speculative step's
tokens (`observe_tokens`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

# Speculative steps after the gate turns back on that count as "just resumed" in both engines' acceptance
# counters: the draft has just caught up over the tokens decoded while off, and a poor catch-up shows here.
RESUMED_STEPS = 32


@dataclass
class GateConfig:
    disable_at: int | None  # None: always speculate
    enable_at: int | None = None
    min_dwell_steps: int = 0

    def __post_init__(self):
        if self.disable_at is not None:
            if self.disable_at < 1:
                raise ValueError(f"gate disable_at must be >= 1, got {self.disable_at}")
            if self.enable_at is None:
                self.enable_at = self.disable_at - 1
            if not 0 <= self.enable_at < self.disable_at:
                raise ValueError(f"gate enable_at must be in [0, disable_at), got {self.enable_at} "
                                 f"with disable_at {self.disable_at}")
        if self.min_dwell_steps < 0:
            raise ValueError(f"gate min_dwell_steps must be >= 0, got {self.min_dwell_steps}")

    @classmethod
    def from_settings(cls, settings: dict) -> GateConfig:
        """From the plugin's SPECGATE_GATE settings (extra keys ignored)."""
        return cls(settings.get("disable_at"), settings.get("enable_at"), settings.get("min_dwell_steps", 0))


@dataclass
class Gate:
    config: GateConfig
    on: bool = True
    steps_on: int = 0
    steps_off: int = 0
    switches: int = 0
    _dwell: int = field(default=0, repr=False)  # steps taken in the current state

    def decide(self, running: int) -> bool:
        """Decide this decode step from the running decode batch size; update the counters."""
        cfg = self.config
        if cfg.disable_at is None and not self.on:  # no threshold (the auto gate lifts its own where speculation
            self._switch(True)  # pays at every batch): speculate
        elif cfg.disable_at is not None and self._dwell >= cfg.min_dwell_steps:
            if self.on and running >= cfg.disable_at:
                self._switch(False)
            elif not self.on and running <= cfg.enable_at:
                self._switch(True)
        self._dwell += 1
        if self.on:
            self.steps_on += 1
        else:
            self.steps_off += 1
        return self.on

    def observe_time(self, running: int, speculated: bool, seconds: float | None) -> None:
        """A fixed threshold needs no measurements (the auto gate's interface: a step's time)."""

    def observe_tokens(self, requests: int, tokens: int) -> None:
        """As observe_time: the tokens a speculative step gave."""

    def _switch(self, on: bool) -> None:
        self.on = on
        self.switches += 1
        self._dwell = 0

    def counters(self) -> dict:
        c = self.config
        return {"gate_on": self.on, "steps_on": self.steps_on, "steps_off": self.steps_off, "switches": self.switches,
                "disable_at": c.disable_at, "enable_at": c.enable_at, "min_dwell_steps": c.min_dwell_steps}  # fmt: skip


# -- the auto gate ----------------------------------------------------------------------------------
#
# No threshold to give: the gate fits the model that decides one (docs/design/auto-gate.md). Per side, a
# step's time against the running batch is a line between the mean points of neighbouring batch-size
# buckets, a stall counting at most twice the line; tau is the tokens a speculative step gives a
# request. Speculation pays while tau * t_plain(b) > t_spec(b): the first batch where it stops, ceil(b*),
# is the threshold of a fixed `Gate`. Probes, steps on the side the gate is not on, keep the unused line
# and tau current, each spending what the model says it loses from a budget.

def bucket(running: int) -> int:
    return max(running, 1).bit_length() - 1  # 1 -> 0, 2-3 -> 1, 4-7 -> 2, ...


@dataclass
class AutoConfig:
    probe_every: int = 200  # the fewest steps between two probes; a new threshold follows each probe
    probe_len: int = 4  # steps per probe (the first after a change of side is not timed)
    probe_budget: float = 0.01  # the share of time probes may lose, by the model's estimate
    memory: int = 32  # timed steps behind each bucket's mean step time (a mean, then an EMA)
    huber: float = 1.0  # a step counts as at most (1 + huber) x its line: a stall moves a bucket's mean little
    tau_memory: int = 768  # request-steps behind tau (a mean, then an EMA)
    hysteresis: float = 0.1  # the gate resumes at disable_at * (1 - hysteresis), and at least two below it
    margin: float = 0.04  # a threshold stays while the model's gain on either side of it is within this of 1
    min_dwell_steps: int = 0  # none: a burst far above the threshold turns the gate off at once
    seed: dict | None = None  # {"plain": [a, c], "spec": [a, c], "tau": t} in seconds, from a sweep's cost model

    def __post_init__(self):
        ok = {"probe_every": self.probe_every > self.probe_len, "probe_len": self.probe_len >= 1, "memory": self.memory >= 1,
              "probe_budget": 0 <= self.probe_budget < 1, "huber": self.huber > 0, "tau_memory": self.tau_memory >= 1,
              "hysteresis": 0 <= self.hysteresis < 1, "margin": 0 <= self.margin < 1}  # min_dwell_steps: GateConfig's
        if bad := [k for k, good in ok.items() if not good]:
            raise ValueError(f"auto gate {bad[0]}: {getattr(self, bad[0])} is out of range (docs/design/auto-gate.md)")


@dataclass
class Line:
    """A step's seconds against the running batch: straight lines between the mean points of the batch-size
    buckets, flat below the first, on along the last segment above the last. Each point is a bucket's mean
    batch and mean step time; forgetting runs per bucket, by its own samples: a load that stays at one batch
    size refreshes that bucket and keeps what the others measured. A line between neighbours, not one line
    through all: a GPU step costs about the same from 1 to 16 requests and then grows, and one straight line
    through both regimes puts a small batch's step time 40% too high and the crossover far too low."""

    buckets: dict = field(default_factory=dict)  # bucket -> [weight, weighted sum of batch, of seconds]
    points: list = field(default_factory=list)  # (mean batch, mean seconds) by batch, never falling

    def __post_init__(self):
        self._refit()

    def __call__(self, b: float) -> float:
        pts = self.points
        if len(pts) < 2 or b <= pts[0][0]:
            return pts[0][1] if pts else 0.0
        i = next((i for i in range(1, len(pts)) if b <= pts[i][0]), len(pts) - 1)  # the segment, or the last
        (b0, t0), (b1, t1) = pts[i - 1], pts[i]
        return t0 + (t1 - t0) * (b - b0) / (b1 - b0)

    def add(self, b: float, t: float, memory: int, huber: float) -> None:
        if self.points and self(b) > 0:  # one-sided Huber: a stall only ever lengthens a step
            t = min(t, (1 + huber) * self(b))
        w, sb, st = self.buckets.get(bucket(b), (0.0, 0.0, 0.0))
        keep = min(1.0, (memory - 1) / max(w, 1e-9))  # a plain mean of the first `memory` samples, then an EMA
        self.buckets[bucket(b)] = [keep * w + 1, keep * sb + b, keep * st + t]
        self._refit()

    def _refit(self) -> None:
        self.points, top = [], 0.0
        for _, (w, sb, st) in sorted(self.buckets.items()):
            top = max(top, st / w)  # a step never gets cheaper with more requests
            self.points.append((sb / w, top))


@dataclass
class AutoGate:
    config: AutoConfig = field(default_factory=AutoConfig)
    lines: dict = field(default_factory=lambda: {"plain": Line(), "spec": Line()})
    tau: float | None = None  # tokens per request per speculative step, over all batch sizes
    tau_samples: int = 0  # request-steps behind it, at most tau_memory
    steps_on: int = 0
    steps_off: int = 0
    probes: int = 0
    _since_probe: int = field(default=0, repr=False)
    _probe_left: int = field(default=0, repr=False)
    _bank: float = field(default=0.0, repr=False)  # seconds of throughput the next probe may lose
    _last_side: bool | None = field(default=None, repr=False)
    _sizes: dict = field(default_factory=lambda: {False: set(), True: set()}, repr=False)  # side -> batches run

    def __post_init__(self):
        cfg = self.config
        self.gate = Gate(GateConfig(None, None, cfg.min_dwell_steps))
        if cfg.seed:  # each line as `memory` steps at batch 1 and at 64, tau as tau_memory samples
            for side in ("plain", "spec"):
                a, c = cfg.seed[side]
                self.lines[side] = Line({bucket(b): [cfg.memory, cfg.memory * b, cfg.memory * (a + c * b)]
                                         for b in (1, 64)})  # fmt: skip
            self.tau, self.tau_samples = float(cfg.seed["tau"]), cfg.tau_memory
            self._set_threshold()

    on = property(lambda self: self.gate.on)
    switches = property(lambda self: self.gate.switches)
    threshold = property(lambda self: self.gate.config.disable_at)  # the fixed gate's, set from b*

    def gain(self, b: int) -> float | None:
        """Speculative tokens/s over plain tokens/s at batch b; None before the model has both sides."""
        tau, plain, spec = self.tau, self.lines["plain"], self.lines["spec"]
        if tau is None or not (plain.points and spec.points):  # a seed fills both
            return None
        # a speculative step does at least a plain step's work: a spec line below the plain one (noise, or
        # batches the spec side has not seen lately) would make speculation pay more than tau
        return tau * plain(b) / max(spec(b), plain(b), 1e-12)

    def crossover(self) -> int | None:
        """The first batch at which speculation stops paying; None if it pays at every batch up to twice the
        largest either side has run (beyond that both lines only extrapolate), or the model is not ready."""
        if self.gain(1) is None:
            return None
        top = 2 * max(line.points[-1][0] for line in self.lines.values())
        return next((b for b in range(1, math.ceil(top) + 1) if self.gain(b) < 1), None)

    def _set_threshold(self) -> None:
        c, t, m, d = self.gate.config, self.crossover(), self.config.margin, self.gate.config.disable_at
        # the model's noise must not move the threshold back and forth: it stays while the new b* is within the
        # band the gate already tolerates, or while the model's gain on either side of it is within margin of 1
        if t is not None and d is not None and (abs(t - d) < d - c.enable_at or
                                                self.gain(d) < 1 + m and self.gain(max(d - 1, 1)) > 1 - m):
            return
        c.disable_at, c.enable_at = t, None if t is None else max(min(math.floor(t * (1 - self.config.hysteresis)), t - 2), 0)

    def decide(self, running: int) -> bool:
        self._since_probe += 1
        if self._since_probe == self.config.probe_len + 1:  # a probe has just ended: the model has news
            self._set_threshold()
        side = self.gate.decide(running)
        # each step banks probe_budget of its time; a probe waits until the bank covers what the model says it
        # loses (its tokens, made the other way), so probes far from the crossover are rarer
        plain, spec, tau = self.lines["plain"](running), self.lines["spec"](running), self.tau
        self._bank += self.config.probe_budget * (spec if side else plain)
        # (free where the other side was never timed nor seeded at batches like these: its line only guesses)
        timed = tau and bucket(running) in self.lines["plain" if side else "spec"].buckets
        loss = self.config.probe_len * max(plain - spec / tau if side else spec - tau * plain, 0.0) if timed else 0.0
        if not self._probe_left and self._since_probe >= self.config.probe_every and loss <= self._bank:
            self._bank, self._probe_left, self._since_probe, self.probes = 0.0, self.config.probe_len, 0, self.probes + 1
        side, self._probe_left = side ^ (self._probe_left > 0), max(self._probe_left - 1, 0)  # a probe runs the other side
        self.steps_on, self.steps_off = self.steps_on + side, self.steps_off + (not side)
        return side

    def observe_time(self, running: int, speculated: bool, seconds: float | None) -> None:
        """A step's time; None for one the engine did not time as typical. Two steps are not fitted: the first
        after a change of side, which carries the draft's catch-up (or the flush), and the first on a side at
        each batch size, which may pay a one-time compile (a draining wave meets a new size every step)."""
        changed, self._last_side = speculated != self._last_side, speculated  # the very first step too
        first_use = running not in self._sizes[speculated]
        self._sizes[speculated].add(running)
        if not changed and not first_use and running >= 1 and seconds is not None and seconds > 0:
            self.lines["spec" if speculated else "plain"].add(running, seconds, self.config.memory, self.config.huber)

    def observe_tokens(self, requests: int, tokens: int) -> None:
        """The tokens a speculative step gave `requests` requests, each one sample of tau: the plain mean of the
        first tau_memory samples, then an EMA (a first step that accepted nothing must not hold tau down)."""
        if requests >= 1:
            self.tau_samples, tau = min(self.tau_samples + requests, self.config.tau_memory), self.tau or 0.0
            self.tau = tau + min(requests / self.tau_samples, 1.0) * (tokens / requests - tau)

    def counters(self) -> dict:
        return {"gate_on": self.on, "steps_on": self.steps_on, "steps_off": self.steps_off, "switches": self.switches,
                "mode": "auto", "auto_threshold": self.threshold, "probes": self.probes, "tau": self.tau and round(self.tau, 3),
                "lines": {k: [[round(b, 1), round(t * 1e3, 3)] for b, t in v.points] for k, v in self.lines.items()}}  # fmt: skip


def make_gate(settings: dict) -> Gate | AutoGate:
    """The gate the settings ask for: {"auto": {AutoConfig fields}} or a fixed threshold (disable_at, ...)."""
    if settings.get("auto") is None:
        return Gate(GateConfig.from_settings(settings))
    if unknown := set(settings["auto"]) - {f.name for f in fields(AutoConfig)}:
        raise ValueError(f"auto gate: unknown settings {sorted(unknown)} (docs/design/auto-gate.md)")
    return AutoGate(AutoConfig(**settings["auto"]))
