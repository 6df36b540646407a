"""SGLang plugin: the specgate load gate inside SGLang's EAGLE-3 worker.

Registered under the `sglang.srt.plugins` entry point; SGLang calls `register()` early
in every process (tokenizer manager, schedulers, every TP rank). It adds hooks through
SGLang's HookRegistry, editing no SGLang file. Two modes:

mode "true-off" (default): while the gate is off a decode step is a plain decode step of the
target, and the draft catches up in one batched extend when drafting resumes. See
`specgate.sglang.trueoff`, with the adapter whose contract the installed SGLang meets
(`specgate.sglang.adapters`: 0.5.15, 0.5.17, 0.5.23). On an SGLang no adapter fits it
falls back to the "sglang-steps0" hooks below, with the same thresholds, and says so once: they
act when the server runs SGLang's adaptive speculation (specgate's launcher then starts it so).

mode "sglang-steps0": SGLang's own adaptive speculation with a 0-step tier (still pays for
the verify-mode step and the draft extend while off):

  AROUND AdaptiveSpeculativeParams.get_steps_for_batch   the gate decides: the configured
         number of draft steps while on, 0 while off. It sees the unpadded decode batch
         size, once per decode step (prefills do not call it).
  AROUND AdaptiveSpeculativeParams.on_verify_complete    returns None: SGLang's
         acceptance-EMA never changes the step count, so only the gate decides.

The decision depends only on the decode batch size, which every TP rank sees, and on
the gate's own deterministic state, so all ranks decide alike every step.

Settings come from the environment, set by specgate's launcher:
  SPECGATE_GATE='{"mode": "true-off", "num_steps": 3, "disable_at": 8, "enable_at": null,
                  "min_dwell_steps": 0, "buffer_tokens": 32}'
(every key is described in config/README.md, "The gate's settings").
"""

from __future__ import annotations

import json
import logging
import os

from specgate.gate import Gate, GateConfig, make_gate
from specgate.sglang.logs import log
from specgate.sglang.logs import say as _say

TARGET = "sglang.srt.speculative.adaptive_spec_params.AdaptiveSpeculativeParams"
ENV = "SPECGATE_GATE"
MODES = ("true-off", "sglang-steps0")
KEYS = {"mode", "num_steps", "disable_at", "enable_at", "min_dwell_steps", "buffer_tokens", "buffer_rows",
        "sync_free_seq_lens", "check_mirror_every", "auto", "control"}
LOG_EVERY = 1000  # decisions between counter lines
# each key's type and smallest value, checked before the gate is built (make_gate checks how they combine)
VALUES = {"disable_at": (int, 1), "enable_at": (int, 0), "min_dwell_steps": (int, 0), "auto": (dict, None),
          "num_steps": (int, 1), "buffer_tokens": (int, 1), "buffer_rows": (int, 1), "check_mirror_every": (int, 0),
          "sync_free_seq_lens": (bool, None), "control": (str, None)}  # fmt: skip


def gate_settings() -> dict | None:
    raw = os.environ.get(ENV)
    if not raw:
        return None
    settings = json.loads(raw)
    unknown = set(settings) - KEYS
    if unknown:
        raise ValueError(f"{ENV}: unknown keys {sorted(unknown)}")
    if settings.setdefault("mode", "true-off") not in MODES:
        raise ValueError(f"{ENV}: mode must be one of {MODES}, got {settings['mode']!r}")
    for key, (kind, least) in VALUES.items():
        value = settings.get(key)
        if value is None:
            continue
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"{ENV}: {key} must be {'an integer' if kind is int else kind.__name__}, got {value!r}")
        if least is not None and value < least:
            raise ValueError(f"{ENV}: {key} must be at least {least}, got {value!r}")
    make_gate(settings)  # the thresholds or the auto gate's settings are checked here, before any hook exists
    if settings.get("auto") is not None and settings["mode"] != "true-off":
        raise ValueError(f"{ENV}: the auto gate needs mode true-off (it times plain and speculative steps)")
    return settings


def _hooked_api():
    """The SGLang pieces the hooks need, or the reason they are missing."""
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
        from sglang.srt.speculative import adaptive_spec_params
    except ImportError as e:
        return None, f"SGLang lacks the plugin or adaptive-speculation API ({e})"
    cls = getattr(adaptive_spec_params, "AdaptiveSpeculativeParams", None)
    missing = [m for m in ("get_steps_for_batch", "on_verify_complete") if not callable(getattr(cls, m, None))]
    if cls is None or missing:
        return None, f"SGLang's AdaptiveSpeculativeParams lacks {missing or 'itself'}"
    return (HookRegistry, HookType), None


def make_hooks(settings: dict):
    """The two AROUND hooks, sharing one gate per AdaptiveSpeculativeParams instance."""
    num_steps = int(settings.get("num_steps", 3))

    def get_steps_for_batch(original, self, batch_size, *args, **kwargs):
        gate = self.__dict__.get("_specgate_gate")
        if gate is None:
            gate = self.__dict__["_specgate_gate"] = Gate(GateConfig.from_settings(settings))
            log.info("specgate gate active: %s, %d draft steps while on (pid %d)", gate.counters(), num_steps, os.getpid())
        before = gate.switches
        on = gate.decide(int(batch_size))
        if gate.switches != before or (gate.steps_on + gate.steps_off) % LOG_EVERY == 0:
            log.info("specgate gate %s at batch %d: %s", "on" if on else "off", batch_size, json.dumps(gate.counters()))
        return num_steps if on else 0

    def on_verify_complete(original, self, *args, **kwargs):
        return None  # acceptance-EMA step changes are switched off: the gate alone decides

    return get_steps_for_batch, on_verify_complete


def register() -> None:
    """Entry point called by SGLang's plugin loader."""
    try:
        settings = gate_settings()
    except (ValueError, json.JSONDecodeError) as e:
        _say(logging.ERROR, f"specgate gate plugin: bad {ENV} ({e}); not installed")
        return
    if settings is None:
        _say(logging.INFO, f"specgate gate plugin: {ENV} not set; not installed")
        return
    if settings["mode"] == "true-off" and _register_true_off(settings):
        return
    if settings.get("auto") is not None:
        _say(logging.WARNING, "specgate gate plugin: the auto gate needs the true-off gate, which this SGLang does not "
                              "fit; not installed, SGLang runs unchanged (always speculating)")  # fmt: skip
        return
    api, reason = _hooked_api()
    if api is None:
        _say(logging.WARNING, f"specgate gate plugin: {reason}; not installed, SGLang runs unchanged")
        return
    registry, hook_type = api
    get_steps, on_verify = make_hooks(settings)
    registry.register(f"{TARGET}.get_steps_for_batch", get_steps, hook_type.AROUND)
    registry.register(f"{TARGET}.on_verify_complete", on_verify, hook_type.AROUND)
    _say(logging.INFO, f"specgate gate plugin: hooks registered on {TARGET} ({settings})")


def _register_true_off(settings: dict) -> bool:
    """Install the true-off hooks; False (and one log line) where no adapter fits this SGLang."""
    from specgate.sglang import trueoff as sglang_trueoff

    adapter, why = sglang_trueoff.select_adapter()
    if adapter is None:
        _say(logging.WARNING, f"specgate true-off gate refused: {why}; falling back to SGLang's adaptive steps=0 "
                              "path with the same thresholds (it acts when the server runs --speculative-adaptive)")  # fmt: skip
        return False
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook in sglang_trueoff.make_hooks(settings, adapter).items():
        HookRegistry.register(target, hook, HookType.AROUND)
    _say(logging.INFO, f"specgate gate plugin: true-off hooks registered on {adapter.TARGETS['forward_batch_generation']} "
                       f"({adapter.LINE} adapter; {settings})")  # fmt: skip
    return True
