"""benchmarks/gate_overhead.py on a machine without SGLang or a GPU: help, dry run, the table, the refusal."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gate_overhead.py"


def run(*args, env=None):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120, env=env)


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gate_overhead", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help_exits_zero():
    r = run("--help")
    assert r.returncode == 0, r.stderr
    assert "--disable-at" in r.stdout and "trueoff_synced" in r.stdout


def test_dry_run_writes_configs_and_prints_server_commands(tmp_path):
    variants = "nospec,trueoff,trueoff_synced,always,steps0"
    r = run("--shape", "llama-3.1-8b", "--variants", variants, "--tp", "2", "--dry-run", "--work-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    target = json.loads((tmp_path / "target" / "config.json").read_text())
    draft = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert (target["hidden_size"], target["num_hidden_layers"], target["vocab_size"]) == (4096, 32, 128256)
    assert draft["architectures"] == ["LlamaForCausalLMEagle3"] and draft["num_hidden_layers"] == 1
    assert json.loads((tmp_path / "adaptive_steps0.json").read_text()) == {"1": {"candidate_steps": [0]}}

    commands = {}
    for line in r.stdout.splitlines():
        if line.startswith("# ") and line[2:] in variants.split(","):
            name = line[2:]
        elif not line.startswith("#"):
            commands[name] = line
    assert set(commands) == set(variants.split(","))
    for name, cmd in commands.items():
        assert "sglang.launch_server" in cmd and "--load-format dummy" in cmd and "--skip-tokenizer-init" in cmd
        assert "--tp-size 2" in cmd and "--grammar-backend none" in cmd
        assert ("--speculative-algorithm EAGLE3" in cmd) == (name != "nospec")
        assert ("--speculative-draft-load-format dummy" in cmd) == (name != "nospec")
        assert ("SGLANG_PLUGINS=specgate_gate" in cmd) == name.startswith("trueoff")
    for name in ("trueoff", "trueoff_synced", "always"):
        assert "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4" in commands[name]
    assert f"--speculative-adaptive --speculative-adaptive-config {tmp_path / 'adaptive_steps0.json'}" in commands["steps0"]
    assert "--speculative-num-steps" not in commands["steps0"]
    assert """SPECGATE_GATE='{"mode": "true-off", "num_steps": 3, "disable_at": 2}'""" in commands["trueoff"]
    assert '"sync_free_seq_lens": false' in commands["trueoff_synced"]


def test_shape_from_json(tmp_path):
    shape = tmp_path / "shape.json"
    shape.write_text(json.dumps({"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
                                 "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000}))  # fmt: skip
    r = run("--shape", str(shape), "--variants", "always", "--dry-run", "--work-dir", str(tmp_path / "w"))
    assert r.returncode == 0, r.stderr
    draft = json.loads((tmp_path / "w" / "draft" / "config.json").read_text())
    assert (draft["hidden_size"], draft["draft_vocab_size"], draft["model_type"]) == (256, 1000, "llama")
    bad = run("--shape", str(tmp_path / "missing.json"), "--dry-run", "--work-dir", str(tmp_path / "w2"))
    assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1


def test_table_ratios(bench):
    results = {
        "nospec": {16: {"tok_s": 2000.0, "decode_tok_s": 2500.0}, 64: {"tok_s": 6000.0, "decode_tok_s": None}},
        "trueoff": {16: {"tok_s": 1900.0, "decode_tok_s": 2000.0}, 64: {"tok_s": 4500.0, "decode_tok_s": 5000.0}},
    }
    lines = bench.format_table(results, ["nospec", "trueoff", "steps0"], [16, 64]).splitlines()
    assert lines[0] == ("| concurrency | nospec tok/s | nospec decode tok/s | trueoff tok/s | trueoff decode tok/s "
                        "| steps0 tok/s | steps0 decode tok/s |")  # fmt: skip
    assert lines[2] == "| 16 | 2,000.0 | 2,500.0 | 1,900.0 (0.95) | 2,000.0 (0.80) | - | - |"
    assert lines[3] == "| 64 | 6,000.0 | - | 4,500.0 (0.75) | 5,000.0 | - | - |"


def test_decode_median(bench):
    log = "\n".join(f"Decode batch, #running-req: {n}, #token: 9, cuda graph: True, gen throughput (token/s): {t}, #queue-req: 0"
                    for n, t in ((16, 100.0), (16, 300.0), (15, 999.0), (16, 200.0)))  # fmt: skip
    assert bench.decode_median(log, 16) == 200.0
    assert bench.decode_median(log, 64) is None


def test_without_sglang_exits_nonzero_with_one_line(tmp_path):
    # a package named sglang that fails to import stands in for a host without SGLang, even where it is installed
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text("raise ImportError('no SGLang here', name='sglang')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    r = run("--work-dir", str(tmp_path / "w"), "--out", str(tmp_path / "t.md"), env=env)
    assert r.returncode != 0
    assert len(r.stderr.strip().splitlines()) == 1 and "sglang" in r.stderr.lower(), r.stderr
    assert not (tmp_path / "t.md").exists()


def test_side_by_side_dry_run_splits_the_gpu(tmp_path):
    r = run("--variants", "nospec,trueoff", "--rounds", "2", "--dry-run", "--work-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if not line.startswith("#")]
    # the first server leaves room for the second; both cap their KV pool at the top level's need
    assert "--mem-fraction-static 0.45" in lines[0] and "--mem-fraction-static 0.85" in lines[1]
    assert all(f"--max-total-tokens {128 * (512 + 256 + 8) + 4096}" in line for line in lines)
    alone = run("--variants", "nospec", "--dry-run", "--work-dir", str(tmp_path / "alone"))
    assert "--mem-fraction-static 0.8" in alone.stdout and "--max-total-tokens" not in alone.stdout
    three = run("--variants", "nospec,trueoff,steps0", "--rounds", "2", "--dry-run")
    assert three.returncode == 2 and "exactly two --variants" in three.stderr


def test_rounds_table_pairs_blocks_of_a_round(bench):
    def block(tok_s, decode):
        return {"tok_s": tok_s, "decode_tok_s": decode}

    results = {"nospec": {16: [block(1000.0, 2000.0), block(1100.0, None)]},
               "trueoff": {16: [block(950.0, 1900.0), block(1100.0, 2100.0)]}}  # fmt: skip
    lines = bench.format_rounds_table(results, ["nospec", "trueoff"], [16]).splitlines()
    assert lines[0].startswith("| c | nospec tok/s | nospec decode tok/s | trueoff tok/s |")
    # client ratios 0.95 and 1.00; the decode ratio has one pair only, since nospec's second block has no line
    assert lines[2] == "| 16 | 1,050.0 | 2,000.0 | 1,025.0 | 2,000.0 | 0.975 [0.950–1.000] | 0.950 [0.950–0.950] | 0.095 / - |"
