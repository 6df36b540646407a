"""The benchmark scripts on a CPU machine: --help, their pure pieces on given numbers, and two
real runs on a tiny random model that write their tables."""

import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specgate.gate import Gate, GateConfig

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = ["capture_vs_forward", "train_mfu", "dp_scaling", "reference_engine", "acceptance_step", "drafter_recipe",
           "reproducibility", "auto_shift", "trueoff_proof", "auto_gate_model", "sweep_noise", "decode_lines", "train_memory",
           "auto_stale_tau", "tau_hat_gap"]
TINY = json.dumps(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512, max_position_embeddings=512))  # fmt: skip


def load(name: str):
    """A benchmark script as a module; its folder on sys.path, as when it runs, for its `common` import."""
    if str(REPO / "benchmarks") not in sys.path:
        sys.path.append(str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, f"benchmarks/{name}.py", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_every_script_has_help():
    # started together: each one's cost is mostly importing torch
    procs = {n: subprocess.Popen([sys.executable, f"benchmarks/{n}.py", "--help"], cwd=REPO, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for n in SCRIPTS}  # fmt: skip
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"{name}: {err}"
        assert "--out" in out and "usage:" in out, name


def test_flop_count_on_given_numbers():
    flops = load("train_mfu").model_flops
    # N = 4 tokens, H = 2, one head of d = 2 (q and kv width 2), I = 3, Vd = 5, one TTT step, 4 rows in the loss:
    # fc 2*4*6*2 = 96; q,k,v,o + MLP 2*4*(2*2*2 + 2*2*2*2 + 2*2 + 3*2*3) = 368; lm_head 2*4*2*5 = 80;
    # causal attention 1*1*2*4*(4*5/2) = 80; model = 3 * 624; the full 4x4 scores add 3 * 2*4*(16 - 10)
    r = flops(batch=1, seq=4, ttt=1, hidden=2, heads=1, kv_heads=1, head_dim=2, intermediate=3, draft_vocab=5, rows=[4])
    assert r["forward"] == {"fc": 96, "qkvo_mlp": 368, "lm_head": 80, "attention_causal": 80}
    assert r["model_flops"] == 1872
    assert r["hardware_flops"] == 1872 + 144
    # a second TTT step: the layer again on all N, its own rows, and k*T more keys per query
    r2 = flops(batch=1, seq=4, ttt=2, hidden=2, heads=1, kv_heads=1, head_dim=2, intermediate=3, draft_vocab=5, rows=[4, 2])
    assert r2["forward"] == {"fc": 96, "qkvo_mlp": 736, "lm_head": 120, "attention_causal": 80 + 8 * (10 + 4)}
    assert load("train_mfu").target_side_flops(batch=2, seq=3, hidden=4, vocab=10, draft_vocab=5) == 2 * 6 * 4 * 15


def test_mfu_row_on_given_numbers():
    m = load("train_mfu")
    run_ = {"trainer": "specgate", "precision": "bf16", "batch": 2, "seq": 1000, "step_s": [0.2, 0.1, 0.3],
            "model_flops": 50e12, "hardware_flops": 60e12, "peak_bytes": 3 * 2**30}  # fmt: skip
    row = m.table_row(run_, peak_tflops=1000.0, matmul_tflops=500.0)
    assert row == ["specgate", "bf16", "2 × 1000", "200.0 (100.0–300.0)", "10000", "50.0", "250.0", "0.250", "0.500",
                   "300.0", "3.0"]  # fmt: skip
    assert len(row) == len(m.COLUMNS)
    oom = {"trainer": "SpecForge", "precision": "bf16", "batch": 1, "seq": 8, "error": "out of memory"}
    failed = m.table_row(oom, None, None)
    assert failed[:4] == ["SpecForge", "bf16", "1 × 8", "out of memory"] and len(failed) == len(m.COLUMNS)


def test_table_writers_on_given_numbers():
    capture = load("capture_vs_forward")
    rows = capture.result_rows(1000, [(1.0, 2.0), (0.5, 0.5), (1.0, 1.25)])
    assert rows == [["1", "1000", "500", "0.500"], ["2", "2000", "2000", "1.000"], ["3", "1000", "800", "0.800"],
                    ["**median**", "1000", "800", "**0.800**"]]  # fmt: skip
    assert capture.markdown_table(["a", "b"], [[1, 2.5]]) == "| a | b |\n|---|---|\n| 1 | 2.5 |"

    engine = load("reference_engine")
    rates = {("nospec", 1): [30.0], ("always", 1): [36.0], ("gate_4", 1): [33.0], ("nospec", 4): [80.0, 100.0, 90.0],
             ("always", 4): [72.0, 70.0, 74.0], ("gate_4", 4): [90.0, 88.0, 89.0]}  # fmt: skip
    assert engine.table_rows(rates, ["nospec", "always", "gate_4"], [1, 4]) == [
        ["1", "30.0", "36.0", "33.0", "1.20", "1.10"],
        ["4", "90.0 (80.0–100.0)", "72.0 (70.0–74.0)", "89.0 (88.0–90.0)", "0.80", "0.99"],
    ]
    # (wall s, timed-step s, step tokens) per repeat: no-spec 100 tokens in 10 s of which 8 in steps; always-on 120
    # tokens in 10 s of which 6 in steps: ×1.20 over wall time, ×1.60 over the steps alone
    split = {("nospec", 2): [(5.0, 4.0, 50), (5.0, 4.0, 50)], ("always", 2): [(10.0, 6.0, 120)]}
    assert engine.split_rows(split, [2]) == [["2", "0.80", "0.60", "1.20", "1.60"]]
    steps = {4: [("spec", 4, 5, 0.120), ("spec", 4, 6, 0.122), ("spec", 2, 3, 0.145), ("plain", 4, 4, 0.1)]}
    assert engine.step_rows(steps) == [["4", "2", "145.0", "1"], ["4", "4", "121.0", "2"]]

    dp = load("dp_scaling")
    median, q1, q3 = dp.rate_summary([1.0, 9.0, 9.0, 9.0, 9.0, 10.0, 20.0, 30.0, 40.0])  # the first 5 steps dropped
    assert (median, q1, q3) == (25.0, 12.5, 37.5)
    results = [
        dict(ranks=1, job_threads=8, threads_per_rank=8, median=1000.0, q1=990.0, q3=1010.0, cpu_s=10.0, wall_s=5.0),
        dict(ranks=2, job_threads=8, threads_per_rank=4, median=1600.0, q1=1500.0, q3=1700.0, cpu_s=21.0, wall_s=6.0),
    ]
    assert dp.table_rows(results)[1] == [2, 8, 4, "1,600 (1,500–1,700)", "0.80", "21.0", "6.0"]
    assert dp.default_settings(gpus=2, cores=32) == [(1, 32), (2, 32), (2, 16)]
    assert dp.default_settings(gpus=0, cores=2) == [(1, 2), (2, 2)]

    step = load("acceptance_step")
    assert step.ms_cell([3.0, 1.0, 2.0]) == "2.0 (1.0–3.0)"
    max_new, max_len = step.token_budget(prompt_len=100, k=3, steps=10, repeats=3)
    assert max_new == (2 * step.WARMUP_STEPS + 61) * 4 + 1 and max_len == 100 + max_new + 5


def test_capture_vs_forward_on_a_tiny_shape(tmp_path):
    from safetensors.torch import save_file

    lengths = [40, 31, 24, 17, 9, 5]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (sum(lengths),), generator=gen, dtype=torch.int32)  # beyond the vocab: wrapped
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    save_file({"input_ids": ids, "loss_mask": torch.ones(len(ids), dtype=torch.uint8), "offsets": offsets},
              str(tmp_path / "tokens.safetensors"))  # fmt: skip
    out = tmp_path / "capture.md"
    r = run("capture_vs_forward", "--shape", TINY, "--tokens", str(tmp_path / "tokens.safetensors"), "--batch-tokens", "64",
            "--batches", "3", "--repeats", "2", "--device", "cpu", "--out", str(out))  # fmt: skip
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert text in r.stdout
    assert "benchmarks/capture_vs_forward.py --shape" in text and "torch " in text and "transformers " in text
    assert "2 repeats" in text
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert table[0] == "| repeat | plain forward tok/s | capture tok/s | capture ÷ plain |"
    assert [row.split(" | ")[0] for row in table[1:]] == ["| 1", "| 2", "| **median**"]


def test_acceptance_step_at_batch_2(tmp_path):
    out = tmp_path / "step.md"
    r = run("acceptance_step", "--shape", TINY, "--batch", "2", "--prompt-len", "16", "--steps", "2", "--repeats", "2",
            "--device", "cpu", "--out", str(out))  # fmt: skip
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert "2 repeats of 2 steps" in text and "torch " in text
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ")][1:]  # after the header
    assert [row[1] for row in rows] == ["2", "1", "2"]  # batch, every other slot, batch
    for row in rows:
        assert float(row[2].split()[0]) > 0


@pytest.mark.parametrize(
    ("name", "args", "message"),
    [
        ("train_mfu", ["--specforge"], "--specforge needs the `specforge` package"),
        ("capture_vs_forward", ["--shape", TINY, "--tokens", "no/such/tokens.safetensors"], "no tokenized set at"),
        ("train_memory", ["--results", "no/such/results"], "run the workflow up to its capture first"),
        ("tau_hat_gap", ["--results", "no/such/results", "--config", "config/config.yaml"], "run the workflow up to"),
    ],
)
def test_missing_prerequisites_are_one_line_errors(name, args, message):
    if name == "train_mfu" and importlib.util.find_spec("specforge") is not None:
        pytest.skip("specforge is installed here")
    r = run(name, *args)
    assert r.returncode != 0
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_recipe_rows_change_one_thing_at_a_time():
    m = load("drafter_recipe")
    rows = m.rows_of_changes()
    assert rows[0][1] == m.PREVIOUS and rows[0][2] == m.PREVIOUS_DATA
    for (_, train_a, data_a), (label, train_b, data_b) in zip(rows, rows[1:]):
        changed = {k for k in train_b if train_a[k] != train_b[k]} | {k for k in data_b if data_a[k] != data_b[k]}
        assert 1 <= len(changed) <= 2, (label, changed)  # warm-up and floor are one schedule change
    # the last row is the recipe the workflow's train stage uses by default, on regenerated replies
    import inspect

    from specgate.pipeline.train import train_drafter

    defaults = {k: v.default for k, v in inspect.signature(train_drafter).parameters.items()}
    final = rows[-1][1]
    for key in ("init", "warmup_steps", "min_lr_ratio"):
        assert final[key] == defaults[key], key
    assert rows[-1][2] == {"regenerated": True, "mask_end_of_turn": True}


def test_reproducibility_agreement_on_given_runs():
    agreement = load("reproducibility").agreement
    runs = [{"pick": "gate_4", "within_noise": ["gate_4", "gate_8"]}, {"pick": "gate_4", "within_noise": ["gate_4"]},
            {"pick": "gate_2", "within_noise": ["gate_2", "gate_4"]}, {"pick": "gate_4", "within_noise": ["gate_4", "gate_8"]}]
    assert agreement(runs) == ("The modal pick, gate_4, recurs in 3 of 4 runs. The modal within-noise set, {gate_4, gate_8}, "
                               "recurs in 2 of 4; 4 of 4 runs name gate_4 within noise of their best gate.")  # fmt: skip


def test_shift_windows_count_tokens_when_they_stream_not_when_requests_end():
    from specgate.sweep.load_client import RequestRecord

    shift = load("auto_shift")
    # one request streaming 4 chunks (8 tokens) over 0.5-3.5 s; one that failed; one that ends past the run
    done = RequestRecord("auto", 1, 0, start_s=0.0, ttft_s=0.5, e2e_s=3.6, itl_s=[1.0, 1.0, 1.0], output_tokens=8)
    failed = RequestRecord("auto", 1, 1, start_s=0.0, error="HTTP 500")
    late = RequestRecord("auto", 1, 2, start_s=3.0, ttft_s=0.5, e2e_s=9.0, itl_s=[2.0], output_tokens=2)
    # windows of 1 s over [0, 4): two tokens per chunk at 0.5, 1.5, 2.5 and 3.5 s; `late` adds one at 3.5 s
    assert shift.windows([done, failed, late], 0, 4, 1) == [2.0, 2.0, 2.0, 3.0]


def test_shift_decisions_settle_when_auto_speculates_on_the_fixed_gates_share_of_steps():
    shift = load("auto_shift")

    def log(on_per_window):  # a poll every 5 s from t = 0; 100 decode steps per window, `on` of them speculative
        out, on_total = [{"t": 0.0, "steps_on": 0, "steps": 0}], 0
        for k, on in enumerate(on_per_window, 1):
            on_total += on
            out.append({"t": 5.0 * k, "steps_on": on_total, "steps": 100 * k})
        return out

    # the shift at 10 s: auto still speculates on 60 and 30 of 100 steps, then on 4 and 2 like the fixed gate
    settled, auto, fixed = shift.decisions_settle(log([90, 90, 60, 30, 4, 2]), log([90, 90, 2, 2, 2, 2]), 10.0)
    assert settled == 15.0  # the end of the first window after the shift from which the shares stay within 0.05
    assert [round(s, 2) for _, s in auto] == [0.6, 0.3, 0.04, 0.02] and len(fixed) == 4
    # a late relapse moves the settling point past it
    assert shift.decisions_settle(log([90, 90, 60, 4, 30, 2]), log([90, 90, 2, 2, 2, 2]), 10.0)[0] == 20.0
    assert shift.decisions_settle(log([90, 90, 60, 30, 4, 30]), log([90, 90, 2, 2, 2, 2]), 10.0)[0] is None


def test_shift_decisions_leave_probes_out():
    shift = load("auto_shift")
    # 100 steps per window; auto off after the shift at 5 s but probing 2 steps in each window
    auto = [{"t": 5.0 * k, "steps_on": 2 * k, "steps": 100 * k, "probes": k} for k in range(5)]
    fixed = [{"t": 5.0 * k, "steps_on": 0, "steps": 100 * k} for k in range(5)]
    settled, shares, _ = shift.decisions_settle(auto, fixed, 5.0)
    assert settled == 5.0 and [s for _, s in shares] == [0.0, 0.0, 0.0]


def test_the_auto_gate_model_chains_acceptance_to_tau_and_ranks_the_envelopes(capsys):
    model = load("auto_gate_model")
    q = model.chain_probability(1.83, 3)
    assert 1 + q + q * q + q**3 == pytest.approx(1.83, abs=1e-6)
    assert model.main(["--seeds", "1", "--concurrency", "1", "16", "--thresholds", "4", "--max-tokens", "32"]) == 0
    rows = dict(line.strip("|").split("|")[:2] for line in capsys.readouterr().out.splitlines()
                if line.startswith("| ") and "variant" not in line)  # fmt: skip
    env = {v.strip(): float(x.split()[0]) for v, x in rows.items()}
    # always-on wins at c = 1 and loses at 16 under the 8B-cost fit: a gate at 4 beats both ends
    assert env["gate_4"] > max(env["nospec"], env["always"]) and env["always"] < 0.7


def test_the_auto_gate_model_dips_the_batch_and_charges_each_switch_on():
    """With successors joining 3 steps after a finish, a level at c = 16 runs below 16 part of the time
    (speculation staggers the finishes); each switch from plain to speculative steps pays the catch-up."""
    model = load("auto_gate_model")
    charged = model.parse_args(["--admit-delay", "3", "--catchup-ms", "50", "0", "--noise", "0", "--max-tokens", "32"])
    free = model.parse_args(["--admit-delay", "3", "--noise", "0", "--max-tokens", "32"])
    q = model.chain_probability(charged.tau, charged.num_steps)

    class Recording(Gate):  # a fixed gate's no-op observe_time / observe_tokens; decide recorded
        def __init__(self, every):
            super().__init__(GateConfig(None))
            self.seen, self.every = [], every

        def decide(self, running):
            self.seen.append(running)
            return len(self.seen) % self.every == 0  # every = 1: always on; 2: on every other step

    always = Recording(1)
    tps = model.level(always, 16, charged, q, random.Random(0))
    assert max(always.seen) == 16 and sum(b < 16 for b in always.seen) > len(always.seen) // 4
    assert tps == pytest.approx(model.level(Recording(1), 16, free, q, random.Random(0)))  # never switches
    flapping = [model.level(Recording(2), 16, args, q, random.Random(0)) for args in (charged, free)]
    assert flapping[0] < 0.5 * flapping[1]  # 50 ms on every other step of ~10 ms


def test_shift_serves_each_variant_on_the_engine_asked_for(tmp_path):
    """The same variants on the reference engine or on SGLang with specgate's plugin (the auto gate as true-off)."""
    shift = load("auto_shift")
    args = ["--target", "t", "--drafter", "d", "--eval", "e.jsonl", "--max-running", "128"]
    auto = shift.Variant("auto", True, auto=True)
    cmd, env = shift.server_command(shift.parse_args(args), auto, 31000, tmp_path)
    assert cmd[1:4] == ["-m", "specgate.cli", "serve"] and "--auto-gate" in cmd
    sglang = shift.parse_args(args + ["--engine", "sglang", "--attention-backend", "triton",
                                      "--extra-args=--sampling-backend pytorch"])  # fmt: skip
    cmd, env = shift.server_command(sglang, auto, 31000, tmp_path)
    assert cmd[1:3] == ["-m", "sglang.launch_server"] and cmd[-2:] == ["--sampling-backend", "pytorch"]
    assert cmd[cmd.index("--attention-backend") + 1] == "triton" and env["SGLANG_PLUGINS"] == "specgate_gate"
    gate = json.loads(env["SPECGATE_GATE"])
    assert gate["mode"] == "true-off" and gate["auto"] == {}
    names = [v.name for v in shift.shift_variants(shift.parse_args(args + ["--thresholds", "4,16"]))]
    assert names == ["auto", "gate_4", "gate_16", "nospec", "always"]
    lean = shift.parse_args(args + ["--thresholds", "4,16", "--no-references"])
    assert [v.name for v in shift.shift_variants(lean)] == ["auto", "gate_4", "gate_16"]


def test_the_auto_gate_model_stalls_first_uses_and_the_gate_does_not_lock_off():
    """The sweep primes the auto gate with a wave of 128; the first speculative step at each batch size pays
    a compile (150 ms against a 7 ms step). A stall counts at most twice its line, so batch 1 still reads
    about its true gain (1.18: tau 1.83 x 4.82 ms / 7.48 ms) and the gate speculates there."""
    from specgate.gate import AutoConfig, AutoGate

    model = load("auto_gate_model")
    a = model.parse_args(["--first-use-stall-ms", "150", "--concurrency", "1", "2", "--max-tokens", "64"])
    gate = AutoGate(AutoConfig())
    model.sweep(lambda: gate, a, model.chain_probability(a.tau, a.num_steps), 0)
    assert gate.gain(1) > 1.1 and gate.steps_on > gate.steps_off, gate.counters()


def test_shift_request_lengths_vary_around_max_tokens_and_repeat_for_every_variant():
    """Equal lengths keep plain-stepping requests in step (their successors share one prefill); on an H200
    the auto server ran 626 prefills where gate_4's ran 269 for that reason alone."""
    shift = load("auto_shift")
    a = shift.parse_args(["--target", "t", "--drafter", "d", "--eval", "e.jsonl", "--max-tokens", "48"])
    lengths = [shift.spread_length(a.max_tokens, a.length_spread, i) for i in range(400)]
    assert lengths == [shift.spread_length(a.max_tokens, a.length_spread, i) for i in range(400)]
    assert min(lengths) >= 36 and max(lengths) <= 60 and len(set(lengths)) > 15
    assert abs(sum(lengths) / len(lengths) - 48) < 1.5
    fixed = shift.parse_args(["--target", "t", "--drafter", "d", "--eval", "e.jsonl", "--length-spread", "0"])
    assert {shift.spread_length(fixed.max_tokens, fixed.length_spread, i) for i in range(50)} == {48}


def test_decode_lines_keeps_the_speculative_servers_plain_steps_at_each_level(tmp_path):
    # lines as SGLang 0.5.15 writes them (an H200 sweep's logs)
    nospec = tmp_path / "nospec.log"
    nospec.write_text(
        "[2026-12-02 18:21:35] Decode batch, #running-req: 128, #token: 23834, token usage: 0.14, cuda graph: True, "
        "gen throughput (token/s): 875.34, #queue-req: 0\n"
        "[2026-12-02 18:21:36] Decode batch, #running-req: 124, #token: 26896, token usage: 0.16, cuda graph: True, "
        "gen throughput (token/s): 6147.24, #queue-req: 0\n"
        "[2026-12-02 18:21:37] Decode batch, #running-req: 126, #token: 26996, token usage: 0.16, cuda graph: True, "
        "gen throughput (token/s): 6200.00, #queue-req: 0\n"
        "[2026-12-02 18:21:38] Decode batch, #running-req: 60, #token: 9000, token usage: 0.05, cuda graph: True, "
        "gen throughput (token/s): 4000.00, #queue-req: 0\n")  # fmt: skip
    spec = tmp_path / "spec.log"
    spec.write_text(
        "[2026-12-02 18:21:39] Decode batch, #running-req: 128, #token: 27073, token usage: 0.07, accept len: 1.82, "
        "accept rate: 0.27, cuda graph: True, gen throughput (token/s): 1909.69, #queue-req: 0\n"
        "[2026-12-02 18:21:42] Decode batch, #running-req: 127, #token: 16949, token usage: 0.04, accept len: 1.00, "
        "accept rate: 0.00, cuda graph: True, gen throughput (token/s): 5207.30, #queue-req: 30\n")  # fmt: skip
    rows = load("decode_lines").main(["--nospec", str(nospec), "--spec", str(spec), "--concurrency", "64", "128"])
    # c = 128: three no-spec lines (median 6,147), one plain-step line; the speculative line is left out
    assert rows[1] == [128, 3, "6,147", 1, "5,207", f"{5207.30 / 6147.24:.3f}"]
    assert rows[0][0] == 64 and rows[0][3] == 0 and rows[0][-1] == "-"  # 60 is not within 5% below 64
