import csv

import pytest
import torch
from conftest import kill_9_when
from safetensors.torch import load_file

from specgate.pipeline.train import train_drafter

SETTINGS = dict(ttt_length=3, epochs=2, batch_tokens=1024, lr=3e-3, checkpoint_every=3, device="cpu", precision="fp32", seed=0)


def _job(tiny_target, tiny_capture, out):
    index, vocab = tiny_capture
    return dict(hidden_states=str(index), vocab_path=str(vocab), target_dir=str(tiny_target),
                out_weights=str(out / "drafter.safetensors"), out_metrics=str(out / "metrics.csv"), **SETTINGS)  # fmt: skip


def _schedule(total: int) -> list[float]:
    """The learning rate logged after each of `total` steps: the default warm-up (20 steps) and floor (0.1)."""
    from specgate.pipeline.train import cosine_with_warmup

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=SETTINGS["lr"])
    sched = cosine_with_warmup(opt, min(20, total), total, 0.1)
    out = []
    for _ in range(total):
        opt.step()
        sched.step()
        out.append(sched.get_last_lr()[0])
    return out


def test_training_learns_and_logs_metrics(tmp_path, tiny_target, tiny_capture):
    train_drafter(**_job(tiny_target, tiny_capture, tmp_path))
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert {"loss_0", "acc_0", "loss_2", "acc_2", "lr", "tokens_per_s", "tau_hat"} <= set(rows[0])
    assert float(rows[-1]["loss"]) < float(rows[0]["loss"])
    r = rows[-1]
    acc = [float(r[f"acc_{k}"]) for k in range(3)]
    assert float(r["tau_hat"]) == pytest.approx(1 + acc[0] + acc[0] * acc[1] + acc[0] * acc[1] * acc[2])
    weights = load_file(tmp_path / "drafter.safetensors")
    assert "midlayer.self_attn.q_proj.weight" in weights and weights["d2t"].dtype == torch.int64


def test_resume_after_kill_9_ends_with_the_same_weights(tmp_path, tiny_target, tiny_capture):
    ref = tmp_path / "ref"
    train_drafter(**_job(tiny_target, tiny_capture, ref))

    out = tmp_path / "killed"
    ckpts = out / "checkpoints"
    kill_9_when("specgate.pipeline.train", _job(tiny_target, tiny_capture, out), tmp_path / "job.json",
                lambda: any(p.name == "step_3" for p in ckpts.glob("step_*")))  # fmt: skip
    assert not (out / "drafter.safetensors").exists(), "the kill must land before the end"
    steps = [int(p.name.split("_")[1]) for p in ckpts.glob("step_*") if ".tmp-" not in p.name]
    assert steps and max(steps) >= 3

    train_drafter(**_job(tiny_target, tiny_capture, out))  # resumes
    got, want = load_file(out / "drafter.safetensors"), load_file(ref / "drafter.safetensors")
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
    with open(out / "metrics.csv") as f, open(ref / "metrics.csv") as g:
        assert [r["step"] for r in csv.DictReader(f)] == [r["step"] for r in csv.DictReader(g)]


def test_ranks_that_drift_apart_are_an_error():
    from types import SimpleNamespace

    from specgate.pipeline.train import check_ranks_agree

    params = [torch.ones(3), torch.zeros(2)]
    same = SimpleNamespace(num_processes=2, device="cpu", gather=lambda t: torch.cat([t, t]))
    check_ranks_agree(params, same)
    drifted = SimpleNamespace(num_processes=2, device="cpu", gather=lambda t: torch.cat([t, t + 0.5]))
    with pytest.raises(RuntimeError, match="ranks' weights differ"):
        check_ranks_agree(params, drifted)


@pytest.mark.slow
def test_two_cpu_ranks_train_one_model(tmp_path, tiny_target, tiny_capture):
    from specgate.pipeline.train import run_training_job

    one, two = tmp_path / "one", tmp_path / "two"
    train_drafter(**_job(tiny_target, tiny_capture, one))
    run_training_job(2, **_job(tiny_target, tiny_capture, two))  # two ranks over gloo; fails if they drift
    rows_one = list(csv.DictReader(open(one / "metrics.csv")))
    rows_two = list(csv.DictReader(open(two / "metrics.csv")))
    # batch_tokens is the global batch: two ranks take about as many steps as one (half a batch each)
    assert abs(len(rows_two) - len(rows_one)) <= max(2, len(rows_one) // 10), (len(rows_one), len(rows_two))
    assert float(rows_two[-1]["loss"]) < float(rows_two[0]["loss"])
    # one schedule step per optimizer step on every rank (Accelerate's prepared scheduler took one per rank)
    assert [float(r["lr"]) for r in rows_two] == pytest.approx(_schedule(len(rows_two)), rel=1e-6, abs=1e-12)
    assert [float(r["lr"]) for r in rows_one] == pytest.approx(_schedule(len(rows_one)), rel=1e-6, abs=1e-12)
    assert load_file(two / "drafter.safetensors").keys() == load_file(one / "drafter.safetensors").keys()


def test_ranks_share_the_jobs_threads():
    import os

    from specgate.runtime import GPU_HOST_THREADS, THREAD_VARS, rank_env, rank_threads

    assert rank_threads(2, {"OMP_NUM_THREADS": "32"}) == 16  # Snakemake's `threads`, split (it was 32 per rank)
    assert rank_threads(8, {"OMP_NUM_THREADS": "4"}) == 1
    assert rank_threads(2, {}) == max(1, (os.cpu_count() or 1) // 2)
    assert rank_threads(2, {"OMP_NUM_THREADS": "32"}, on_gpu=True) == GPU_HOST_THREADS
    assert rank_threads(8, {"OMP_NUM_THREADS": "8"}, on_gpu=True) == 1
    # every variable Snakemake sets for a job's threads, not only OMP's (MKL's stayed at 32 per rank)
    snakemake_job = {name: "32" for name in THREAD_VARS} | {"PATH": "/bin"}
    env = rank_env(2, snakemake_job, on_gpu=False)
    assert {env[name] for name in THREAD_VARS} == {"16"} and env["PATH"] == "/bin"


def test_schedule_warms_up_by_steps_and_ends_on_its_floor():
    from specgate.pipeline.train import cosine_with_warmup

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = cosine_with_warmup(opt, 10, 100, 0.1)
    lrs = [sched.get_last_lr()[0]]
    for _ in range(100):
        opt.step()
        sched.step()
        lrs.append(sched.get_last_lr()[0])
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)  # linear over 10 steps
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))  # then only down
    assert lrs[100] == pytest.approx(0.1) and min(lrs) == pytest.approx(0.1)


def test_step_budget_cycles_the_data_and_the_logged_loss_uses_loss_decay(tmp_path, tiny_target, tiny_capture):
    job = _job(tiny_target, tiny_capture, tmp_path) | {"epochs": 1, "steps": 11, "batch_tokens": 8192, "loss_decay": 0.5,
                                                     "checkpoint_every": 100}
    train_drafter(**job)
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, 12))
    assert int(rows[-1]["epoch"]) >= 1, "11 steps must take more than one pass over the tiny set"
    for r in rows:
        assert float(r["loss"]) == pytest.approx(sum(0.5**k * float(r[f"loss_{k}"]) for k in range(3)), rel=1e-6)


@pytest.mark.parametrize("init", ["random", "target_head"])
def test_init_copies_the_head_only_when_asked(tiny_target, init):
    from transformers import AutoConfig, AutoModelForCausalLM

    from specgate.model.drafter import Eagle3Drafter, drafter_config

    target = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    token_ids = torch.arange(0, 64, 2)
    drafter = Eagle3Drafter(drafter_config(AutoConfig.from_pretrained(tiny_target), len(token_ids), [0, 1, 2]))
    drafter.init_from_target(target, token_ids, copy_head=init == "target_head")
    copied = torch.equal(drafter.lm_head.weight, target.get_output_embeddings().weight[token_ids])
    assert copied == (init == "target_head")
    assert drafter.to_target_ids(torch.arange(len(token_ids))).tolist() == token_ids.tolist()


def test_bf16_precision_runs_on_bf16_copies_and_saves_fp32_masters(tmp_path, tiny_target, tiny_capture):
    job = _job(tiny_target, tiny_capture, tmp_path) | {"precision": "bf16", "steps": 6, "checkpoint_every": 100}
    train_drafter(**job)
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 6 and float(rows[-1]["loss"]) < float(rows[0]["loss"])
    weights = load_file(tmp_path / "drafter.safetensors")
    assert weights["fc.weight"].dtype == torch.float32
    # fp32 masters take steps a bf16 weight could not: some weights are not bf16-representable
    fc = weights["fc.weight"]
    assert not torch.equal(fc, fc.to(torch.bfloat16).float())


def test_online_capture_gives_the_offline_states_and_the_same_training(tmp_path, tiny_target, tiny_tokens, tiny_capture):
    """capture.mode online: the target runs on each training batch. Its states are the shards' states
    (up to float rounding of a different batch shape), and training on them follows the offline run."""
    from specgate.pipeline.capture import OnlineCapture
    from specgate.pipeline.train import CapturedSequences, collate

    index, vocab = tiny_capture
    offline = CapturedSequences(index)
    online = OnlineCapture(tiny_tokens, tiny_target, torch.device("cpu"), layers=None, dtype="float32")
    assert len(online) == len(offline) and online.index["layers_sglang"] == offline.index["layers_sglang"]
    ids = [0, 5, 17]
    want, got = collate([offline[i] for i in ids]), collate([online[i] for i in ids])
    assert "aux_hidden" not in got
    online.fill(got)
    assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["valid"], want["valid"])
    for key in ("aux_hidden", "final_hidden"):
        assert got[key].shape == want[key].shape and got[key].dtype == want[key].dtype
        torch.testing.assert_close(got[key], want[key], atol=1e-4, rtol=1e-4)
    assert not got["aux_hidden"][~got["valid"]].any(), "padding is zero, as in a batch read from shards"

    short = {"steps": 6, "checkpoint_every": 100}
    ref = tmp_path / "offline"
    train_drafter(**_job(tiny_target, tiny_capture, ref) | short)
    out = tmp_path / "online"
    train_drafter(**_job(tiny_target, tiny_capture, out) | short | {
        "hidden_states": str(tiny_tokens), "capture": {"mode": "online", "layers": None, "dtype": "float32"}})
    assert not list(out.glob("**/*shard*")), "online mode writes no hidden states"
    with open(ref / "metrics.csv") as f, open(out / "metrics.csv") as g:
        a, b = list(csv.DictReader(f)), list(csv.DictReader(g))
    assert len(a) == len(b) == 6
    assert float(b[-1]["loss"]) < float(b[0]["loss"])
    assert [float(r["loss"]) for r in b] == pytest.approx([float(r["loss"]) for r in a], rel=1e-3)


def test_each_epoch_batches_the_sequences_anew_within_the_token_budget():
    import random

    from specgate.pipeline.train import epoch_batches

    rng = random.Random(0)
    lengths = [rng.randint(20, 300) for _ in range(400)]
    epochs = [epoch_batches(lengths, 1024, seed=0, epoch=e) for e in range(3)]
    for batches in epochs:
        assert sorted(i for b in batches for i in b) == list(range(400))  # every sequence once
        assert all(max(lengths[i] for i in b) * len(b) <= 1024 or len(b) == 1 for b in batches)
    pairs = [{frozenset(b) for b in batches} for batches in epochs]
    assert len(pairs[0] & pairs[1]) < len(pairs[0]) / 2, "an epoch must not repeat the last one's batches"
    assert epochs[1] == epoch_batches(lengths, 1024, seed=0, epoch=1), "and it depends only on (seed, epoch)"


def test_heldout_sequences_give_tau_hat_at_each_evaluation_and_acceptance_reads_it(tmp_path, tiny_target, tiny_capture):
    from specgate.pipeline.acceptance import predicted_tau
    from specgate.pipeline.train import heldout_split

    assert heldout_split(100, 64, 0) == heldout_split(100, 64, 0) and len(heldout_split(100, 64, 0)) == 10
    train_drafter(**_job(tiny_target, tiny_capture, tmp_path) | {"steps": 7, "heldout_sequences": 16, "eval_every": 3})
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    evaluated = [int(r["step"]) for r in rows if r["heldout_tau_hat"]]
    assert evaluated == [3, 6, 7]
    last = rows[-1]
    acc = [float(last[f"heldout_acc_{k}"]) for k in range(3)]
    assert 0 <= min(acc) and max(acc) <= 1
    assert float(last["heldout_tau_hat"]) == pytest.approx(1 + acc[0] + acc[0] * acc[1] + acc[0] * acc[1] * acc[2])
    decoded = [float(last[f"heldout_tau_{j}"]) for j in (1, 2, 3)]
    assert all(1 <= tau <= 1 + j for j, tau in zip((1, 2, 3), decoded, strict=True))
    assert [int(r["step"]) for r in rows if r["heldout_tau_3"]] == evaluated
    assert predicted_tau(str(tmp_path / "metrics.csv"), 2) == pytest.approx(decoded[1]), "acceptance reads the decoded tau"


def test_the_decoded_path_keeps_leading_hits_and_jumps_past_them():
    from specgate.pipeline.train import decoded_path

    # one reply at positions 4..9: the prefill gives token 4, the first drafts start at anchor 3 (guessing 5 on)
    mask = torch.zeros(1, 12, dtype=torch.bool)
    mask[0, 4:10] = True
    hits = torch.zeros(2, 1, 12, dtype=torch.bool)
    hits[0, 0, 3:8] = True  # the first draft hits from anchors 3-7
    hits[1, 0, 3] = True  # the second draft only from anchor 3
    # one draft a step: anchor 3 keeps 1 + bonus, anchor 5 the same, anchor 7 has one token left (9)
    # two drafts: anchor 3 keeps 2 + bonus, anchor 6 keeps 1 + bonus, and the reply is done
    assert decoded_path(hits, mask) == [(5, 3), (5, 2)]
    # a hit after a miss is not kept: anchor 3's second draft hits after its first missed, so anchor 3 keeps only
    # the bonus; anchor 4 keeps 1 + bonus, anchor 6 has two tokens left: three steps (counted, it would be two)
    hits[0, 0, 3], hits[1, 0, 3], hits[1, 0, 4], hits[1, 0, 5:8] = False, True, False, True
    assert decoded_path(hits, mask)[1] == (5, 3)
