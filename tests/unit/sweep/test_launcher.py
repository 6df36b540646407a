import json

import pytest

from specgate.gate import GateConfig
from conftest import sglang_dirs

from specgate.sweep.launcher import ADAPTIVE_MAX_STEPS, ServeSettings, Variant, reference_command, sglang_command, variants


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_variants_cover_nospec_always_thresholds_and_hysteresis():
    vs = variants([2, 8], [[8, 4]], [8])
    assert [v.name for v in vs] == ["nospec", "always", "gate_2", "gate_8", "gate_8_4", "steps0_8"]
    assert [v.gate_mode for v in vs if v.gated] == ["true-off"] * 3 + ["sglang-steps0"]


def test_sglang_gated_command(tmp_path):
    s = ServeSettings("/m/target", "/m/drafter", num_steps=3, max_running=128, tp=2, attention_backend="flashinfer",
                      extra_args=["--mem-fraction-static", "0.8"], env={"NCCL_NVLS_ENABLE": "0"})  # fmt: skip
    cmd, env = sglang_command(s, Variant("steps0_8", True, 8, None, 4, "sglang-steps0"), 31000, tmp_path)
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    assert _flag(cmd, "--speculative-algorithm") == "EAGLE3" and _flag(cmd, "--speculative-draft-model-path") == "/m/drafter"
    assert _flag(cmd, "--speculative-num-steps") == "3" and _flag(cmd, "--speculative-eagle-topk") == "1"
    assert _flag(cmd, "--speculative-num-draft-tokens") == "4"
    assert _flag(cmd, "--max-running-requests") == "128" and _flag(cmd, "--tp-size") == "2"
    assert _flag(cmd, "--attention-backend") == "flashinfer" and cmd[-2:] == ["--mem-fraction-static", "0.8"]
    adaptive = json.loads(open(_flag(cmd, "--speculative-adaptive-config")).read())
    assert adaptive == {"1": {"candidate_steps": [0, 3]}}
    gate = json.loads(env["SPECGATE_GATE"])
    assert gate == {"mode": "sglang-steps0", "num_steps": 3, "disable_at": 8, "enable_at": None, "min_dwell_steps": 4}
    GateConfig(gate["disable_at"], gate["enable_at"], gate["min_dwell_steps"])  # the plugin accepts it
    assert env["NCCL_NVLS_ENABLE"] == "0"


def test_sglang_true_off_gate_needs_no_adaptive_tier(tmp_path):
    s = ServeSettings("/m/target", "/m/drafter", num_steps=3, gate_buffer_tokens=48)
    cmd, env = sglang_command(s, Variant("gate_8", True, 8), 31000, tmp_path)
    assert "--speculative-adaptive" not in cmd and _flag(cmd, "--speculative-num-steps") == "3"
    gate = json.loads(env["SPECGATE_GATE"])
    assert gate == {"mode": "true-off", "num_steps": 3, "disable_at": 8, "enable_at": None, "min_dwell_steps": 0,
                    "buffer_tokens": 48, "sync_free_seq_lens": True}  # fmt: skip
    s.gate_sync_free_seq_lens, s.gate_check_mirror_every = False, 100
    gate = json.loads(sglang_command(s, Variant("gate_8", True, 8), 31000, tmp_path)[1]["SPECGATE_GATE"])
    assert (gate["sync_free_seq_lens"], gate["check_mirror_every"]) == (False, 100)
    with pytest.raises(ValueError, match="always a true off"):
        reference_command(s, Variant("steps0_8", True, 8, gate_mode="sglang-steps0"), 1)


def test_sglang_nospec_and_always(tmp_path):
    s = ServeSettings("/m/target", "/m/drafter")
    nospec, env = sglang_command(s, Variant("nospec", False), 1, tmp_path)
    assert "--speculative-algorithm" not in nospec and "SPECGATE_GATE" not in env
    always, env = sglang_command(s, Variant("always", True), 1, tmp_path)
    assert "--speculative-adaptive" not in always and "SPECGATE_GATE" not in env


def test_reference_command_mirrors_the_settings():
    s = ServeSettings("/m/target", "/m/drafter", num_steps=5, max_running=16)
    cmd, _ = reference_command(s, Variant("gate_4_2", True, 4, 2), 31001)
    assert cmd[1:4] == ["-m", "specgate.cli", "serve"]
    assert _flag(cmd, "--draft") == "/m/drafter" and _flag(cmd, "--num-steps") == "5"
    assert _flag(cmd, "--disable-at") == "4" and _flag(cmd, "--enable-at") == "2" and _flag(cmd, "--max-running") == "16"
    nospec, _ = reference_command(s, Variant("nospec", False), 1)
    assert "--draft" not in nospec


def test_a_tp_that_cannot_split_the_heads_fails_before_launch(tmp_path):
    from specgate.sweep.launcher import check_tensor_parallel

    target, draft = tmp_path / "target", tmp_path / "draft"
    for d, heads in ((target, 9), (draft, 8)):
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"num_attention_heads": heads}))
    check_tensor_parallel(1, target, draft)
    check_tensor_parallel(3, target, None)
    with pytest.raises(ValueError, match=r"serve.tp = 2: .*target/config.json has num_attention_heads = 9"):
        check_tensor_parallel(2, target, draft)
    with pytest.raises(ValueError, match=r"serve.tp = 3: .*draft/config.json has num_attention_heads = 8"):
        check_tensor_parallel(3, target, draft)


def test_the_auto_variant_in_both_engines(tmp_path, monkeypatch):
    from specgate.sweep import launcher
    from specgate.sweep.launcher import variants

    auto = next(v for v in variants([4], auto=True) if v.name == "auto")
    assert auto.gated and auto.disable_at is None
    s = ServeSettings("/m/target", "/m/drafter", num_steps=3)
    cmd, _ = reference_command(s, auto, 1)
    assert "--auto-gate" in cmd and "--disable-at" not in cmd
    monkeypatch.setattr(launcher, "true_off_unavailable", lambda: None)
    cmd, env = sglang_command(s, auto, 31000, tmp_path)
    gate = json.loads(env["SPECGATE_GATE"])
    assert gate["mode"] == "true-off" and gate["auto"] == {} and gate["disable_at"] is None
    monkeypatch.setattr(launcher, "true_off_unavailable", lambda: "SGLang 0.5.23 is not 0.5.15")
    with pytest.raises(ValueError, match="bench.auto: the auto gate needs specgate's true-off gate"):
        sglang_command(s, auto, 31000, tmp_path)


def test_the_launch_line_is_the_sweeps_command_with_only_the_variables_it_sets(tmp_path, monkeypatch):
    import shlex

    from specgate.sweep.launcher import launch_line

    monkeypatch.setenv("UNRELATED", "x")
    s = ServeSettings("/m/target", "/m/drafter", num_steps=3, max_running=64, attention_backend="triton",
                      extra_args=["--grammar-backend", "none"], env={"SGLANG_PLUGINS": "specgate_gate"})  # fmt: skip
    line = launch_line("sglang", s, Variant("gate_8", True, 8), tmp_path)
    assert line["argv"][:3] == ["python", "-m", "sglang.launch_server"] and _flag(line["argv"], "--port") == "30000"
    assert set(line["env"]) == {"SGLANG_PLUGINS", "SPECGATE_GATE"}
    gate = json.loads(line["env"]["SPECGATE_GATE"])
    assert gate["disable_at"] == 8 and gate["mode"] == "true-off" and "control" not in gate
    # the shell line parses back to the same variables and command
    words = shlex.split(line["command"])
    assert words[:2] == [f"SGLANG_PLUGINS={line['env']['SGLANG_PLUGINS']}", f"SPECGATE_GATE={line['env']['SPECGATE_GATE']}"]
    assert words[2:] == line["argv"]
    ref = launch_line("reference", s, Variant("gate_8", True, 8), tmp_path)
    assert ref["argv"][:2] == ["specgate", "serve"] and _flag(ref["argv"], "--disable-at") == "8"
    plain = launch_line("sglang", s, Variant("nospec", False), tmp_path)
    assert "SPECGATE_GATE" not in plain["env"] and "--speculative-algorithm" not in plain["argv"]


def test_sglang_own_adaptive_speculation_is_its_default_tiers_on_a_server_of_its_own(tmp_path):
    from specgate.sweep.launcher import gate_mode

    vs = variants([8], sglang_adaptive=True)
    adaptive = vs[-1]
    assert [v.name for v in vs] == ["nospec", "always", "gate_8", "sglang_adaptive"]
    assert not adaptive.gated and not adaptive.switchable and gate_mode(adaptive) == "sglang-adaptive"
    assert all(v.switchable for v in vs[:-1])
    cmd, env = sglang_command(ServeSettings("/m/target", "/m/drafter", extra_args=["--x"]), adaptive, 1, tmp_path)
    assert "--speculative-adaptive" in cmd and "--speculative-adaptive-config" not in cmd  # SGLang's own tiers
    # SGLang sizes its draft buffers from these flags, and its tiers reach 7 steps (it failed to start with 3 / 4)
    assert (_flag(cmd, "--speculative-num-steps"), _flag(cmd, "--speculative-num-draft-tokens")) == ("7", "8")
    assert cmd[-1] == "--x"
    assert "SPECGATE_GATE" not in env  # no specgate gate: SGLang alone decides
    with pytest.raises(ValueError, match="always a true off"):
        reference_command(ServeSettings("/m/target", "/m/drafter"), adaptive, 1)


@pytest.mark.parametrize("sglang_dir", sglang_dirs() or [pytest.param(None, marks=pytest.mark.skip("no SGLang source"))])
def test_every_sglang_release_has_the_adaptive_flag_and_default_tiers_that_end_at_0_steps(sglang_dir):
    """The variant's flag is a ServerArgs field of the release, and its default tiers (no config file) stop
    drafting at the largest batches: what the comparison with the gate is about."""
    import ast
    from pathlib import Path

    package = Path(sglang_dir) / "sglang"
    # ServerArgs' fields: in the class itself, or (0.5.23) in the argument groups it is built from
    fields = {n.target.id for path in [package / "srt/server_args.py", *(package / "srt/arg_groups/fields").glob("*.py")]
              for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}  # fmt: skip
    assert "speculative_adaptive" in fields
    module = ast.parse((package / "srt/speculative/adaptive_spec_params.py").read_text())
    node = next(n for n in module.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                and "DEFAULT_ADAPTIVE_CONFIG" in ast.unparse(n.targets[0] if isinstance(n, ast.Assign) else n.target))  # fmt: skip
    tiers = ast.literal_eval(node.value)
    assert tiers[max(tiers, key=int)]["candidate_steps"] == [0] and 3 in tiers["1"]["candidate_steps"]
    assert max(max(t["candidate_steps"]) for t in tiers.values()) == ADAPTIVE_MAX_STEPS  # what the launcher sizes for
