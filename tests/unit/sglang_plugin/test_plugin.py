"""The gate plugin against real SGLang source (0.5.15 and the newest release), on CPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import sglang_dirs

from specgate.gate import Gate, GateConfig

HERE = Path(__file__).parent


def run_check(sglang_dir, gate, trace, script="check_plugin.py"):
    env = dict(os.environ, SPECGATE_GATE=json.dumps(gate))
    if sglang_dir:
        env["PYTHONPATH"] = os.pathsep.join([sglang_dir, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(HERE / script), json.dumps(trace)],
                          capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    return result, proc.stdout


@pytest.mark.parametrize("sglang_dir", sglang_dirs() or [pytest.param(None, marks=pytest.mark.skip("no SGLang"))])
@pytest.mark.parametrize(
    "gate",
    [
        {"mode": "sglang-steps0", "num_steps": 3, "disable_at": 4},
        {"mode": "sglang-steps0", "num_steps": 5, "disable_at": 8, "enable_at": 3, "min_dwell_steps": 2},
    ],
)
def test_gate_decides_sglang_steps(sglang_dir, gate):
    trace = [1, 2, 3, 4, 5, 9, 16, 7, 5, 4, 3, 2, 1, 1, 8, 8, 2, 1]
    result, log = run_check(sglang_dir, gate, trace)
    ref = Gate(GateConfig(gate["disable_at"], gate.get("enable_at"), gate.get("min_dwell_steps", 0)))
    assert result["steps"] == [gate["num_steps"] if ref.decide(b) else 0 for b in trace]
    assert 0 in result["steps"] and gate["num_steps"] in result["steps"]
    assert result["ema"] == [None] * 50, "SGLang's acceptance EMA must not change steps"
    assert "Executed general plugin: specgate_gate" in log  # found through the entry point
    assert "specgate gate off at batch" in log


def test_plugin_refuses_cleanly_without_the_hooked_api(tmp_path):
    # an SGLang whose adaptive_spec_params lacks AdaptiveSpeculativeParams.get_steps_for_batch
    pkg = tmp_path / "sglang" / "srt"
    (pkg / "plugins").mkdir(parents=True)
    (pkg / "speculative").mkdir()
    for d in (tmp_path / "sglang", pkg, pkg / "speculative"):
        (d / "__init__.py").write_text("")
    (pkg / "plugins" / "__init__.py").write_text("")
    (pkg / "plugins" / "hook_registry.py").write_text("class HookRegistry: pass\nclass HookType: AROUND = 'around'\n")
    (pkg / "speculative" / "adaptive_spec_params.py").write_text("class AdaptiveSpeculativeParams:\n    pass\n")
    code = "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n" \
           "from specgate.sglang.plugin import register; register()"  # fmt: skip
    env = dict(os.environ, SPECGATE_GATE=json.dumps({"mode": "sglang-steps0", "disable_at": 4}), PYTHONPATH=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    lines = [line for line in out.splitlines() if "specgate gate plugin" in line]
    assert len(lines) == 1 and "lacks ['get_steps_for_batch', 'on_verify_complete']" in lines[0]
    assert "not installed" in lines[0]
    # before SGLang configures logging (as when its plugin loader runs), the line still reaches stderr
    code = "from specgate.sglang.plugin import register; register()"
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stderr
    said = [line for line in err.splitlines() if line.startswith("[specgate] specgate gate plugin:")]
    assert len(said) == 1 and "lacks ['get_steps_for_batch', 'on_verify_complete']" in said[0]


def _srt(sglang_dir) -> Path:
    if sglang_dir:
        return Path(sglang_dir) / "sglang" / "srt"
    from specgate.sglang.trueoff import sglang_source_dir

    return sglang_source_dir()


def _version(srt: Path) -> str:
    from specgate.sglang.contract import installed_version

    return installed_version(srt)


@pytest.mark.parametrize("sglang_dir", sglang_dirs() or [pytest.param(None, marks=pytest.mark.skip("no SGLang"))])
def test_each_release_gets_the_adapter_written_for_it_and_its_hooks(sglang_dir):
    """The contract picks the adapter: each release the adapters list is matched by its own adapter's
    contract and by no other; the plugin then registers that adapter's hooks, and only those."""
    from specgate.sglang import contract, trueoff

    srt = _srt(sglang_dir)
    version = _version(srt)
    adapter, why = trueoff.select_adapter(srt)
    meant = [a for a in trueoff.adapters() if version in a.RELEASES]
    matched = [a.LINE for a in trueoff.adapters() if not contract.mismatches(srt, a.CONTRACT, a.FIELDS)]
    result, log = run_check(sglang_dir, {"disable_at": 4, "buffer_tokens": 16}, [], script="check_trueoff.py")
    assert result["version"] == version
    if meant:
        assert adapter is meant[0] and why is None and matched == [adapter.LINE]
        expected = set(adapter.TARGETS.values()) | set(adapter.release_hooks(lambda: None))
        assert {t: v for t, v in result["hooks"].items() if t in expected} == dict.fromkeys(expected, ["around"])
        assert f"({adapter.LINE} adapter;" in log and "true-off hooks registered" in log
    else:  # a release no adapter was written for: true-off refused cleanly, SGLang's steps=0 path gated instead
        assert adapter is None and version in why
        assert "specgate true-off gate refused" in log and "falling back to SGLang's adaptive steps=0 path" in log
        from specgate.sglang.plugin import TARGET

        assert result["hooks"].get(f"{TARGET}.get_steps_for_batch") == ["around"]


@pytest.mark.parametrize("sglang_dir", sglang_dirs() or [pytest.param(None, marks=pytest.mark.skip("no SGLang"))])
def test_the_launcher_runs_steps0_where_true_off_does_not_fit(sglang_dir, monkeypatch, tmp_path):
    import json

    from specgate.sglang import trueoff
    from specgate.sweep import launcher

    srt = _srt(sglang_dir)
    monkeypatch.setattr(trueoff, "sglang_source_dir", lambda: srt)
    launcher.true_off_unavailable.cache_clear()
    launcher.true_off_adapter.cache_clear()
    s = launcher.ServeSettings(target="t", draft="d", num_steps=3, max_running=64)
    try:
        cmd, env = launcher.sglang_command(s, launcher.Variant("gate_8", True, 8, 4), 1, tmp_path)
        adapter_line = launcher.true_off_adapter()  # what the sweep's summary and report name
    finally:
        launcher.true_off_unavailable.cache_clear()
        launcher.true_off_adapter.cache_clear()
    gate = json.loads(env[launcher.GATE_ENV])
    if trueoff.contract_mismatch(srt) is None:
        assert gate["mode"] == "true-off" and "--speculative-adaptive" not in cmd
        assert adapter_line == trueoff.select_adapter(srt)[0].LINE == f"SGLang {_version(srt)}"
    else:  # the same thresholds on SGLang's own 0-step path
        assert gate["mode"] == "sglang-steps0" and (gate["disable_at"], gate["enable_at"]) == (8, 4)
        assert "--speculative-adaptive" in cmd and adapter_line is None


def _copy_contract_files(src: Path, dst: Path, adapter) -> Path:
    import shutil

    for rel in {**adapter.CONTRACT, **adapter.FIELDS}:  # just the files the contract reads
        (dst / "srt" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / rel, dst / "srt" / rel)
    return dst / "srt"


def test_contract_names_the_first_internal_that_changed(tmp_path):
    from specgate.sglang import contract
    from specgate.sglang.adapters import v0_5_15

    dirs = [d for d in sglang_dirs() if d is None or "0.5.15" in d]
    if not dirs:
        pytest.skip("no SGLang 0.5.15")
    srt = _copy_contract_files(_srt(dirs[0]), tmp_path, v0_5_15)
    tables = v0_5_15.CONTRACT, v0_5_15.FIELDS
    assert contract.mismatches(srt, *tables) == []
    worker = srt / "speculative/eagle_worker_v2.py"
    text = worker.read_text()
    worker.write_text(text.replace("def forward_batch_generation(self, batch: ScheduleBatch, on_publish=None)",
                                   "def forward_batch_generation(self, batch: ScheduleBatch, grammar_barrier=None)"))  # fmt: skip
    assert contract.mismatches(srt, *tables) == [
        "speculative/eagle_worker_v2.py: EAGLEWorkerV2.forward_batch_generation takes "
        "['self', 'batch', 'grammar_barrier'], expected ['self', 'batch', 'on_publish']"
    ]
    # a parameter added after the expected ones is a change too
    worker.write_text(text.replace("def forward_batch_generation(self, batch: ScheduleBatch, on_publish=None)",
                                   "def forward_batch_generation(self, batch: ScheduleBatch, on_publish=None, g=None)"))  # fmt: skip
    assert "takes ['self', 'batch', 'on_publish', 'g']" in contract.mismatches(srt, *tables)[0]
    (srt / "managers/utils.py").write_text("class GenerationBatchResult:\n    logits_output: int = 0\n")
    worker.write_text(text)
    assert "GenerationBatchResult.next_token_ids is missing" in contract.mismatches(srt, *tables)[0]
    fields = v0_5_15.FIELDS["managers/utils.py"]["GenerationBatchResult"]
    assert len(contract.mismatches(srt, *tables, first=False)) == len(fields) - 1  # every field but logits_output


def test_a_release_no_adapter_fits_is_refused_with_each_adapters_first_difference(tmp_path):
    """The newest source with one hooked signature changed: no adapter fits, and the one line says why for each."""
    from specgate.sglang import trueoff
    from specgate.sglang.adapters import v0_5_23

    dirs = [d for d in sglang_dirs() if d is not None and "0.5.23" in d]
    if not dirs:
        pytest.skip("no SGLang 0.5.23")
    srt = _copy_contract_files(_srt(dirs[0]), tmp_path, v0_5_23)
    assert trueoff.select_adapter(srt) == (v0_5_23, None)
    worker = srt / "speculative/eagle_worker_v2.py"
    worker.write_text(worker.read_text().replace("pp_proxy_tensors", "pp_proxies"))
    adapter, why = trueoff.select_adapter(srt)
    assert adapter is None and "\n" not in why
    for a in trueoff.adapters():
        assert f"{a.LINE}: " in why
    assert "SGLang 0.5.23: speculative/eagle_worker_v2.py: EAGLEWorkerV2.forward_batch_generation takes" in why


@pytest.mark.parametrize("settings, message", [
    ({"disable_at": "8"}, "disable_at must be an integer"),
    ({"disable_at": 8, "buffer_tokens": 0}, "buffer_tokens must be at least 1"),
    ({"disable_at": 8, "sync_free_seq_lens": 1}, "sync_free_seq_lens must be bool"),
    ({"disable_at": 8, "enable_at": 9}, "enable_at must be in [0, disable_at)"),
    ({"disable_at": 8, "treshold": 4}, "unknown keys ['treshold']"),
])  # fmt: skip
def test_a_bad_gate_setting_is_one_line_naming_the_key(monkeypatch, settings, message):
    from specgate.sglang.plugin import gate_settings

    monkeypatch.setenv("SPECGATE_GATE", json.dumps(settings))
    with pytest.raises(ValueError) as e:
        gate_settings()
    assert message in str(e.value) and "\n" not in str(e.value)
