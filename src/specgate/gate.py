"""The load gate: speculate while the running decode batch is small, stop above a threshold.

Pure policy, no torch and no sglang: the reference engine and the SGLang plugin share it.
Per decode step it sees the number of running decode requests (prefills do not count) and
answers whether this step drafts.

    on  -> off   when running >= disable_at
    off -> on    when running <= enable_at   (enable_at defaults to disable_at - 1)
    a switch is allowed only after min_dwell_steps steps in the current state

Hysteresis (enable_at < disable_at - 1) and the dwell keep the gate from flapping when
the load hovers at the threshold.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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

    def _switch(self, on: bool) -> None:
        self.on = on
        self.switches += 1
        self._dwell = 0

    def counters(self) -> dict:
        c = self.config
        return {"gate_on": self.on, "steps_on": self.steps_on, "steps_off": self.steps_off, "switches": self.switches,
                "disable_at": c.disable_at, "enable_at": c.enable_at, "min_dwell_steps": c.min_dwell_steps}  # fmt: skip
