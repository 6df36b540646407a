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
pays (docs/design/auto-gate.md). Both answer `decide(running)` and take `observe(...)` per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
                raise ValueError(f"gate enable_at must be in [0, disable_at), got {self.enable_at} with disable_at {self.disable_at}")
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
        if cfg.disable_at is not None and self._dwell >= cfg.min_dwell_steps:
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

    def observe(self, running: int, speculated: bool, seconds: float, tokens: int) -> None:
        """A fixed threshold needs no measurements (the auto gate's interface)."""

    def observe_time(self, running: int, speculated: bool, seconds: float, probe: bool | None = None) -> None:
        """As observe."""

    @property
    def probing(self) -> bool:
        return False

    def observe_tokens(self, requests: int, tokens: int) -> None:
        """As observe."""

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
# No threshold: the gate measures, per batch-size bucket (1, 2-3, 4-7, 8-15, ...), what a plain step
# and a speculative step cost, and, over all speculative steps, how many tokens per request one yields
# (tau: a property of the traffic, not of the batch size, so one estimate converges fastest). It
# speculates where tau * plain_s / spec_s (speculative tokens/s over plain tokens/s) is above 1:
#
#   off -> on   when the gain in the current bucket is >= 1 + margin
#   on  -> off  when it is < 1 - margin                  (the margin and a dwell keep it from flapping)
#
# A bucket the gate has not measured on a side is predicted from a line through the buckets it has
# (step time is close to fixed + per-request x batch). Where that prediction is within warm_band of 1,
# or cannot be made yet, the gate tries the side for a few steps instead (the warm-up); far from 1 it
# trusts the prediction, so a burst to a new large batch costs no speculative steps. Seeds from the
# sweep's cost model replace all of that. At most every probe_every steps, and only while the
# throughput probes lose stays within probe_budget of the time, the gate takes probe_len steps of the
# side it is not on, so the estimate it is not using follows a change of workload; the first step after
# any change of side is not measured (it carries the draft's catch-up). Step times come from the engine.


LINE_EVERY = 16  # samples on a side between two fits of the line through its buckets


def bucket(running: int) -> int:
    return max(running, 1).bit_length() - 1  # 1 -> 0, 2-3 -> 1, 4-7 -> 2, ...


def bucket_middle(b: int) -> int:
    return (3 << b) // 2 if b else 1  # the batch a bucket's gain is quoted at: 1, 3, 6, 12, 24, ...


@dataclass
class AutoConfig:
    margin: float = 0.03
    probe_every: int = 200  # the fewest steps between probes of the other side
    probe_len: int = 2
    probe_budget: float = 0.01  # the share of time whose throughput probes may lose
    warm_band: float = 0.1  # a predicted gain within this of 1 is measured (warm-up) rather than trusted
    alpha: float = 0.05  # EMA weight of a step on the side in use
    probe_alpha: float = 0.25  # and of a probe step: few of them, so each counts more
    warmup_steps: int = 3  # measured steps per side and bucket before the estimate is trusted
    probe_floor_every: int = 2000  # a probe at least this often, whatever the budget says (a wrong estimate heals)
    min_dwell_steps: int = 8
    outlier: float = 3.0  # a step measured at more than this many times its estimate counts as this many (a stall)
    seed: dict | None = None  # bucket -> {"plain_s", "spec_s", "tau"}, e.g. from the sweep's cost model

    def __post_init__(self):
        if not 0 <= self.margin < 1:
            raise ValueError(f"auto gate margin must be in [0, 1), got {self.margin}")
        for key in ("probe_every", "probe_len", "warmup_steps", "probe_floor_every"):
            if getattr(self, key) < 1:
                raise ValueError(f"auto gate {key} must be >= 1, got {getattr(self, key)}")
        if self.probe_len >= self.probe_every:
            raise ValueError("auto gate probe_len must be below probe_every")
        for key in ("probe_budget", "warm_band"):
            if not 0 <= getattr(self, key) < 1:
                raise ValueError(f"auto gate {key} must be in [0, 1), got {getattr(self, key)}")
        if self.outlier <= 1:
            raise ValueError(f"auto gate outlier must be > 1, got {self.outlier}")
        for key in ("alpha", "probe_alpha"):
            if not 0 < getattr(self, key) <= 1:
                raise ValueError(f"auto gate {key} must be in (0, 1], got {getattr(self, key)}")


@dataclass
class _Side:
    """Step time against batch size inside one bucket: a line fitted to exponentially weighted samples,
    so a side measured at batch 9 and the other at batch 15 are still compared at the same batch."""

    w: float = 0.0  # the weighted sums of 1, b, b*b, t, b*t
    sb: float = 0.0
    sbb: float = 0.0
    st: float = 0.0
    sbt: float = 0.0
    n: int = 0  # measured steps
    first: list = field(default_factory=list)  # the warm-up's samples, (b, t, weight), until it ends

    def add(self, b: float, t: float, a: float, warmup: int = 0) -> None:
        self._accumulate(b, t, a)
        self.n += 1
        if self.n <= warmup:
            self.first.append((b, t, a))
            if self.n == warmup:
                self._drop_stalls()

    def _drop_stalls(self) -> None:
        """End of the warm-up: refit without any sample above twice the samples' median. A stall (a kernel's
        first compile, a host hiccup) only ever lengthens a step, and among three samples one such would
        otherwise set the estimate: on an H200 one speculative step at batch 1 timed at ~40x its cost held
        the gate off at batch 1 for a whole sweep."""
        times = sorted(t for _, t, _ in self.first)
        median = times[len(times) // 2]
        kept = [x for x in self.first if x[1] <= 2 * median]
        if len(kept) < len(self.first):
            self.w = self.sb = self.sbb = self.st = self.sbt = 0.0
            for x in kept:
                self._accumulate(*x)
        self.first = []

    def _accumulate(self, b: float, t: float, a: float) -> None:
        k = 1 - a
        self.w, self.sb, self.sbb = k * self.w + a, k * self.sb + a * b, k * self.sbb + a * b * b
        self.st, self.sbt = k * self.st + a * t, k * self.sbt + a * b * t

    def spread(self) -> bool:
        """Whether the samples spread over enough batch sizes (sd >= 1/8 of the mean) to give a slope."""
        mb = self.sb / self.w
        return self.sbb / self.w - mb * mb >= (mb / 8) ** 2

    def seconds(self, b: float, slope: float | None = None) -> float:
        """At batch b, with the samples' own slope, or `slope` (from elsewhere) where they do not spread."""
        mb, mt = self.sb / self.w, self.st / self.w
        if slope is None:
            var = self.sbb / self.w - mb * mb
            slope = (self.sbt / self.w - mb * mt) / var if var > 1e-9 * max(mb * mb, 1) else 0.0
        # a step never gets cheaper with more requests, and its fixed part is never below zero: samples
        # bunched at one batch with a few at the next would otherwise give any slope at all
        return mt + min(max(slope, 0.0), mt / mb) * (b - mb)


@dataclass
class AutoGate:
    config: AutoConfig = field(default_factory=AutoConfig)
    on: bool = True
    steps_on: int = 0
    steps_off: int = 0
    switches: int = 0
    probes: int = 0
    estimates: dict = field(default_factory=dict)  # bucket -> {"plain": _Side, "spec": _Side}
    tau: float | None = None  # EMA of tokens per request per speculative step, all buckets
    tau_samples: int = 0  # request-steps behind tau
    _dwell: int = field(default=0, repr=False)
    _probing: int = field(default=0, repr=False)  # probe steps left
    _since_probe: int = field(default=0, repr=False)
    _budget: dict = field(default_factory=dict, repr=False)  # bucket -> seconds its probes may still lose
    _last_side: bool | None = field(default=None, repr=False)
    _last_probe: bool = field(default=False, repr=False)
    _lines: dict = field(default_factory=dict, repr=False)  # side -> (line through the buckets, samples then)
    _samples: dict = field(default_factory=lambda: {"plain": 0, "spec": 0}, repr=False)

    def __post_init__(self):
        for b, s in (self.config.seed or {}).items():
            n = self.config.warmup_steps
            mid = bucket_middle(int(b))
            self.estimates[int(b)] = {"plain": _Side(1.0, mid, mid * mid, s["plain_s"], mid * s["plain_s"], n),
                                      "spec": _Side(1.0, mid, mid * mid, s["spec_s"], mid * s["spec_s"], n)}  # fmt: skip
            self.tau = s["tau"]
            self.tau_samples = 1 << 20  # a seed stands for a sweep's worth of samples

    def _est(self, running: int) -> dict:
        return self.estimates.setdefault(bucket(running), {"plain": _Side(), "spec": _Side()})

    def _line(self, side: str) -> tuple[float, float] | None:
        """Step time a + c * batch through the measured buckets of one side (each bucket's weighted mean,
        weighted by 1/t^2 so each fits to the same relative error); None under two buckets. Read twice a
        step but moving slowly, it is refitted after LINE_EVERY samples on that side or a bucket turning warm."""
        cached = self._lines.get(side)
        if cached is not None and self._samples[side] - cached[1] < LINE_EVERY:
            return cached[0]
        n = sw = sb = st = sbb = sbt = 0.0
        lo, hi = float("inf"), 0.0  # the measured buckets' batch span
        for e in self.estimates.values():
            x = e[side]
            if x.n < self.config.warmup_steps or x.w <= 0:
                continue
            b, t = x.sb / x.w, x.st / x.w
            lo, hi = min(lo, b), max(hi, b)
            wi = 1 / (t * t)
            n, sw, sb, st, sbb, sbt = n + 1, sw + wi, sb + wi * b, st + wi * t, sbb + wi * b * b, sbt + wi * b * t
        line = None
        if n >= 2:
            mb, mt = sb / sw, st / sw
            var = sbb / sw - mb * mb
            if var > 1e-9 * max(mb * mb, 1):
                slope = (sbt / sw - mb * mt) / var
                # a step never gets cheaper with more requests: a line falling by over a fifth across the
                # measured buckets says one of them is wrong, so it predicts nothing (the gate measures instead)
                if slope * (hi - lo) >= -0.2 * (mt + slope * (lo - mb)):
                    slope = max(slope, 0.0)
                    line = (mt - slope * mb, slope)
        self._lines[side] = (line, self._samples[side])
        return line

    def seconds(self, running: int, side: str) -> float | None:
        """A step's time on one side ("plain" or "spec") at this batch: measured in its bucket, or predicted."""
        x = self._est(running)[side]
        if x.n >= self.config.warmup_steps and x.spread():
            return x.seconds(running)
        line = self._line(side)
        if x.n >= self.config.warmup_steps:  # measured at one batch size: its mean, the line's slope
            return x.seconds(running, 0.0 if line is None else line[1])
        return None if line is None else line[0] + line[1] * running

    def gain(self, running: int) -> float | None:
        """Speculative tokens/s over plain tokens/s at this batch, measured in its bucket or predicted from the
        others; None until it can be either."""
        return self._gain(self.seconds(running, "plain"), self.seconds(running, "spec"))

    def _gain(self, plain_s: float | None, spec_s: float | None) -> float | None:
        if plain_s is None or spec_s is None or spec_s <= 0 or self.tau is None:
            return None
        return self.tau * plain_s / spec_s

    def _probe_loss(self, plain_s: float, spec_s: float) -> float:
        """Seconds of throughput lost by probe_len steps of the side the gate is not on (tau known)."""
        per_step = plain_s - spec_s / self.tau if self.on else spec_s - self.tau * plain_s  # the tokens, made the other way
        return self.config.probe_len * max(per_step, 0.0)

    def decide(self, running: int) -> bool:
        cfg, e = self.config, self._est(running)
        self._dwell += 1
        self._since_probe += 1
        side = self.on
        plain_s, spec_s = self.seconds(running, "plain"), self.seconds(running, "spec")  # once per step
        g = self._gain(plain_s, spec_s)
        measured = min(e["plain"].n, e["spec"].n) >= cfg.warmup_steps
        if g is None or not measured and abs(g - 1) < cfg.warm_band:  # warm-up: measure the side this bucket lacks
            side = e["plain"].n >= e["spec"].n
            self._last_probe = False
        elif self._probing:
            self._probing -= 1
            side = not self.on
            self._last_probe = True
        else:
            self._last_probe = False
            # the dwell stops flapping near the crossover; a gain far from 1 (a burst) switches at once
            if self._dwell > cfg.min_dwell_steps or abs(g - 1) >= cfg.warm_band:
                if self.on and g < 1 - cfg.margin or not self.on and g >= 1 + cfg.margin:
                    self.on = side = not self.on
                    self.switches += 1
                    self._dwell = 0
            # each bucket's probes are paid for by its own steps, so they cost <= probe_budget of its time
            b = bucket(running)  # g is known here, so are both step times
            self._budget[b] = self._budget.get(b, 0.0) + cfg.probe_budget * (spec_s if self.on else plain_s)
            loss = self._probe_loss(plain_s, spec_s)
            # the floor: an estimate far from the truth predicts a loss the budget never covers, and only a
            # probe would show it wrong
            due = loss <= self._budget[b] or self._since_probe >= cfg.probe_floor_every
            if self._since_probe >= cfg.probe_every and due:  # next: the other side
                self._budget[b] -= loss
                self._since_probe = 0
                self._probing = cfg.probe_len
                self.probes += 1
        if side:
            self.steps_on += 1
        else:
            self.steps_off += 1
        return side

    @property
    def probing(self) -> bool:
        """Whether the step just decided is a probe of the side the gate is not on."""
        return self._last_probe

    def _alpha(self, probe: bool | None = None) -> float:
        """EMA weight of a step: a probe step counts more (there are few of them)."""
        return self.config.probe_alpha if (self._last_probe if probe is None else probe) else self.config.alpha

    def observe(self, running: int, speculated: bool, seconds: float, tokens: int) -> None:
        """The engine's measurement of the step just decided: its wall time and the tokens it produced."""
        self.observe_time(running, speculated, seconds)
        if speculated:
            self.observe_tokens(running, tokens)

    def observe_time(self, running: int, speculated: bool, seconds: float | None, probe: bool | None = None) -> None:
        """A step's time alone (an engine that learns the accepted tokens later calls observe_tokens then).
        probe: whether that step was a probe, for an engine that reports a step after deciding later ones
        (default: the step just decided). seconds None: a step the engine did not time as typical (one
        that also caught the draft up); it still counts as the side's first step."""
        changed = self._last_side is not None and speculated != self._last_side
        self._last_side = speculated
        if changed or running < 1 or seconds is None or seconds <= 0:
            return  # the first step on a side carries the catch-up (or the switch): not typical
        name, cfg = "spec" if speculated else "plain", self.config
        est = self._est(running)
        side, alpha = est[name], self._alpha(probe)
        if side.n >= cfg.warmup_steps:
            expected = side.seconds(running)
            if seconds * cfg.outlier < expected:
                # no step runs several times faster than it costs, so the estimate was carried by stalls:
                # start it again from this step, still warm (otherwise only probes, at their budget, would wear it down)
                side, alpha = _Side(n=cfg.warmup_steps - 1), 1.0
                est[name] = side
            else:
                seconds = min(seconds, cfg.outlier * expected)  # one stalled step must not carry the estimate for long
        side.add(running, seconds, alpha, cfg.warmup_steps)
        self._samples[name] += 1
        if side.n == cfg.warmup_steps:  # a bucket joins the line
            self._lines.pop(name, None)

    def observe_tokens(self, requests: int, tokens: int) -> None:
        """The tokens a speculative step gave `requests` requests: each request is one sample of tau."""
        if requests < 1:
            return
        # the mean of all samples while they are few, then an EMA: a first step that accepted nothing must
        # not hold the gate off for the hundreds of samples an EMA needs to forget it
        self.tau_samples += requests
        w = max(1 - (1 - self._alpha() / 8) ** requests, requests / self.tau_samples)
        self.tau = tokens / requests if self.tau is None else self.tau + w * (tokens / requests - self.tau)

    def threshold(self) -> int | None:
        """The smallest batch size from which on the gate would now stop speculating (None: it never would):
        the lowest bucket whose gain, and every known gain above it, is below 1."""
        known = [(b, g) for b in sorted(self.estimates) if (g := self.gain(bucket_middle(b))) is not None]
        out = None
        for b, g in reversed(known):
            if g >= 1:
                break
            out = 1 << b
        return out

    def counters(self) -> dict:
        c = self.config
        gains = {1 << b: round(g, 3) for b in sorted(self.estimates) if (g := self.gain(bucket_middle(b))) is not None}
        return {"gate_on": self.on, "steps_on": self.steps_on, "steps_off": self.steps_off, "switches": self.switches,
                "mode": "auto", "auto_threshold": self.threshold(), "probes": self.probes, "margin": c.margin,
                "probe_every": c.probe_every, "min_dwell_steps": c.min_dwell_steps, "gains": gains,
                "tau": None if self.tau is None else round(self.tau, 3)}  # fmt: skip


def make_gate(settings: dict) -> Gate | AutoGate:
    """The gate the settings ask for: {"auto": {AutoConfig fields}} or a fixed threshold (disable_at, ...)."""
    if settings.get("auto") is not None:
        return AutoGate(AutoConfig(**settings["auto"]))
    return Gate(GateConfig.from_settings(settings))
