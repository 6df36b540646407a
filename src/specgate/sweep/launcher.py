"""Server commands for the two engines, built from the same settings.

SGLang: `python -m sglang.launch_server` with the target, the exported EAGLE-3 drafter,
top-k 1, k draft steps and k + 1 draft tokens. A gated variant hands the gate settings to
the specgate plugin through the SPECGATE_GATE environment variable. The true-off gate
(`gate_T`) needs nothing else. The comparison variant `steps0_T` uses SGLang's own 0-step
path: it turns on SGLang's adaptive speculation with a config that lists both step counts
(0 and k), so CUDA graphs are captured for each. The comparison variant `sglang_adaptive` is SGLang's
own adaptive speculation as it ships (`--speculative-adaptive` with its default batch-size tiers), with
no specgate gate; its step flags are the tiers' largest (7 steps, 8 draft tokens), since SGLang sizes
its draft buffers from them. `--max-running-requests` is always explicit: with EAGLE, SGLang otherwise
lowers it to 48.

On an SGLang that the true-off gate does not fit (no adapter's contract matches its internals,
`specgate.sglang.trueoff.contract_mismatch`), a true-off variant runs SGLang's own 0-step path
instead, with the same thresholds and hysteresis; the launcher says so once in the log, and the
mode that ran is in the variant's summary (`gate_mode`).

Reference engine: `python -m specgate.cli serve` with the same meaning for every knob.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from specgate.sglang.plugin import ENV as GATE_ENV

log = logging.getLogger(__name__)


ADAPTIVE_MAX_STEPS = 7  # the most draft steps SGLang's default adaptive tiers pick (0.5.15-0.5.23: [1, 3, 7] or [1, 3, 5, 7])


@dataclass
class Variant:
    """One server configuration of the sweep."""

    name: str  # nospec | always | gate_T | gate_T_E | steps0_T | auto | sglang_adaptive
    speculative: bool
    disable_at: int | None = None
    enable_at: int | None = None
    min_dwell_steps: int = 0
    gate_mode: str = "true-off"  # or "sglang-steps0": SGLang's adaptive 0-step tier; "sglang-adaptive": SGLang's own
    auto: bool = False  # the auto gate: no threshold (specgate.gate.AutoGate)

    @property
    def gated(self) -> bool:
        return self.speculative and (self.disable_at is not None or self.auto)

    @property
    def switchable(self) -> bool:
        """Whether the switched design's speculative server can run it: SGLang's own adaptive speculation
        needs a server of its own."""
        return self.gate_mode != "sglang-adaptive"


def variants(thresholds: list[int], hysteresis: list[list[int]] | None = None, steps0_thresholds: list[int] | None = None,
             auto: bool = False, sglang_adaptive: bool = False) -> list[Variant]:  # fmt: skip
    out = [Variant("nospec", False), Variant("always", True)] + ([Variant("auto", True, auto=True)] if auto else [])
    out += [Variant(f"gate_{t}", True, t) for t in thresholds]
    out += [Variant(f"gate_{d}_{e}", True, d, e) for d, e in hysteresis or []]
    out += [Variant(f"steps0_{t}", True, t, gate_mode="sglang-steps0") for t in steps0_thresholds or []]
    out += [Variant("sglang_adaptive", True, gate_mode="sglang-adaptive")] if sglang_adaptive else []
    return out


@dataclass
class ServeSettings:
    target: str
    draft: str | None
    num_steps: int = 3
    max_running: int = 64
    max_len: int = 2048
    tp: int = 1
    attention_backend: str | None = None
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    device: str = "cpu"
    dtype: str = "auto"  # reference engine only; SGLang serves the checkpoint's dtype
    gate_buffer_tokens: int = 32  # true-off gate in SGLang: aux states kept per request before a flush
    gate_sync_free_seq_lens: bool = True  # true-off gate in SGLang: skip spec v2's seq_lens sync after off steps
    gate_check_mirror_every: int = 0  # true-off gate in SGLang, debug: compare that mirror with the device


def check_tensor_parallel(tp: int, *model_dirs: str | Path | None) -> None:
    """Fail before launching when `serve.tp` cannot split a model's attention heads: SGLang would
    assert on every rank about a minute into start-up (SmolLM2-135M has 9 heads: no tp 2)."""
    if tp == 1:
        return
    for d in model_dirs:
        if d is None:
            continue
        path = Path(d) / "config.json"
        heads = json.loads(path.read_text()).get("num_attention_heads")
        if heads is not None and heads % tp:
            raise ValueError(f"serve.tp = {tp}: {path} has num_attention_heads = {heads}, which {tp} GPUs cannot "
                             f"split evenly; pick a tp that divides {heads}")  # fmt: skip


@functools.cache
def true_off_unavailable() -> str | None:
    """Why the installed SGLang cannot run the true-off gate, or None. No SGLang at all is None:
    the server's start reports that itself."""
    from specgate.sglang import trueoff

    if trueoff.sglang_source_dir() is None:
        return None
    reason = trueoff.contract_mismatch()
    if reason:
        log.warning("the true-off gate does not fit this SGLang (%s): gated variants run SGLang's own adaptive "
                    "steps=0 path instead, with the same thresholds and hysteresis", reason)  # fmt: skip
    return reason


@functools.cache
def true_off_adapter() -> str | None:
    """The SGLang adapter the true-off gate runs through on the installed SGLang (e.g. "SGLang 0.5.17"), or None."""
    from specgate.sglang import trueoff

    if trueoff.sglang_source_dir() is None:
        return None
    adapter, _ = trueoff.select_adapter()
    return adapter.LINE if adapter is not None else None


def gate_mode(v: Variant) -> str | None:
    """The gate mode a variant's SGLang server runs: its own, or sglang-steps0 where true-off does not fit."""
    if v.gate_mode == "sglang-adaptive":
        return v.gate_mode
    if not v.gated:
        return None
    return "sglang-steps0" if v.gate_mode == "true-off" and true_off_unavailable() else v.gate_mode


def gate_settings(v: Variant) -> dict:
    """The gate a variant runs, in SPECGATE_GATE's keys (also what a run-time switch sends)."""
    if v.auto:
        return {"auto": {"min_dwell_steps": v.min_dwell_steps} if v.min_dwell_steps else {}}
    return {"disable_at": v.disable_at, "enable_at": v.enable_at, "min_dwell_steps": v.min_dwell_steps}


def sglang_command(s: ServeSettings, v: Variant, port: int, work_dir: str | Path,
                   control: str | None = None) -> tuple[list[str], dict]:  # fmt: skip
    """`control`: a gate-control file; the server runs the true-off gate and switches it at run time."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", s.target, "--host", "127.0.0.1",
           "--port", str(port), "--max-running-requests", str(s.max_running), "--tp-size", str(s.tp)]  # fmt: skip
    if s.attention_backend:
        cmd += ["--attention-backend", s.attention_backend]
    env = dict(os.environ, **s.env)
    if v.speculative:
        # SGLang's own adaptive tiers reach ADAPTIVE_MAX_STEPS, and it sizes its draft buffers from these flags
        k = ADAPTIVE_MAX_STEPS if v.gate_mode == "sglang-adaptive" else s.num_steps
        cmd += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(s.draft),
                "--speculative-num-steps", str(k), "--speculative-eagle-topk", "1",
                "--speculative-num-draft-tokens", str(k + 1)]  # fmt: skip
    if v.gate_mode == "sglang-adaptive":  # SGLang's default tiers: no config file, no specgate gate
        return cmd + ["--speculative-adaptive"] + list(s.extra_args), env
    if control is not None:
        if gate_mode(Variant("switched", True, 1)) != "true-off":
            raise ValueError("bench.design switched: switching the gate at run time needs specgate's true-off gate, "
                             f"which the installed SGLang does not fit ({true_off_unavailable()}); use design paired")  # fmt: skip
        gate = {"mode": "true-off", "num_steps": s.num_steps, **gate_settings(v), "control": str(control),
                "buffer_tokens": s.gate_buffer_tokens, "sync_free_seq_lens": s.gate_sync_free_seq_lens}  # fmt: skip
        env[GATE_ENV] = json.dumps(gate)
    elif v.gated:
        mode = gate_mode(v)
        if v.auto and mode != "true-off":
            raise ValueError("bench.auto: the auto gate needs specgate's true-off gate, which the installed SGLang "
                             f"does not fit ({true_off_unavailable()})")  # fmt: skip
        gate = {"mode": mode, "num_steps": s.num_steps, "disable_at": v.disable_at, "enable_at": v.enable_at,
                "min_dwell_steps": v.min_dwell_steps}  # fmt: skip
        if v.auto:
            gate["auto"] = {"min_dwell_steps": v.min_dwell_steps} if v.min_dwell_steps else {}
        if mode == "sglang-steps0":
            cfg_path = Path(work_dir) / f"adaptive_{v.name}.json"
            cfg_path.parent.mkdir(parents=True, exist_ok=True)
            # one slot for every batch size: the gate, not SGLang's batch-size table, picks 0 or k
            cfg_path.write_text(json.dumps({"1": {"candidate_steps": [0, s.num_steps]}}))
            cmd += ["--speculative-adaptive", "--speculative-adaptive-config", str(cfg_path)]
        else:
            gate.update(buffer_tokens=s.gate_buffer_tokens, sync_free_seq_lens=s.gate_sync_free_seq_lens)
            if s.gate_check_mirror_every:
                gate["check_mirror_every"] = s.gate_check_mirror_every
        env[GATE_ENV] = json.dumps(gate)
    return cmd + list(s.extra_args), env


def reference_command(s: ServeSettings, v: Variant, port: int, control: str | None = None) -> tuple[list[str], dict]:
    if v.gate_mode != "true-off":  # steps0_T and sglang_adaptive are SGLang's; the config check says so first
        raise ValueError(f"variant {v.name}: the reference engine's gate is always a true off, not {v.gate_mode}")
    cmd = [sys.executable, "-m", "specgate.cli", "serve", "--target", s.target, "--port", str(port),
           "--max-running", str(s.max_running), "--max-len", str(s.max_len), "--device", s.device, "--dtype", s.dtype]  # fmt: skip
    if v.speculative:
        cmd += ["--draft", str(s.draft), "--num-steps", str(s.num_steps)]
    if control is not None:
        cmd += ["--gate-control", str(control)]
    if v.auto:
        cmd += ["--auto-gate"] + (["--min-dwell-steps", str(v.min_dwell_steps)] if v.min_dwell_steps else [])
    elif v.gated:
        cmd += ["--disable-at", str(v.disable_at), "--min-dwell-steps", str(v.min_dwell_steps)]
        if v.enable_at is not None:
            cmd += ["--enable-at", str(v.enable_at)]
    return cmd + list(s.extra_args), dict(os.environ, **s.env)


def launch_line(engine: str, s: ServeSettings, v: Variant, work_dir: str | Path, port: int = 30000) -> dict:
    """What deploys variant `v` outside the sweep: {"env": the variables to set, "argv": the server
    command, "command": both as one shell line}. The same flags the sweep's server ran with, on `port`
    and without the sweep's run-time gate control."""
    import shlex

    if engine == "sglang":
        argv, env = sglang_command(s, v, port, work_dir)
        argv = ["python", *argv[1:]]
    else:
        argv, env = reference_command(s, v, port)
        argv = ["specgate", *argv[3:]]  # python -m specgate.cli serve ... -> specgate serve ...
    keep = {k: env[k] for k in sorted(set(s.env) | {GATE_ENV}) if k in env}
    line = " ".join([*(f"{k}={shlex.quote(val)}" for k, val in keep.items()), *map(shlex.quote, argv)])
    return {"variant": v.name, "env": keep, "argv": argv, "command": line}
