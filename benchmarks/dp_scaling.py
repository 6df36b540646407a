"""Drafter training throughput against data-parallel ranks and host threads per rank.

    python benchmarks/dp_scaling.py WORK_DIR --out dp-scaling.md                      # every GPU of the host
    python benchmarks/dp_scaling.py WORK_DIR --settings 1:32,2:32,2:8 --out dp.md     # RANKS:JOB_THREADS,...

Runs specgate's own training job (`run_training_job`, as the workflow's train rule does) once
per setting, on synthetic inputs made once in WORK_DIR: a random-init target of SmolLM2-135M's
shape (or `--shape`), random chat-length token sequences, their captured hidden states and a
draft vocabulary. Step cost does not depend on the weights or token values, so these stand in
for real data. Later calls with the same WORK_DIR reuse the inputs.

Each setting is a fresh process whose environment carries JOB_THREADS in every thread variable
Snakemake sets for a rule's `threads`; the job splits them among its ranks as the workflow does
(on a GPU a rank keeps at most a few: its host work is collation and copies). The table gives
each setting's median tokens/s over the steps after the first 5 (all ranks together: a step's
tokens over rank 0's step time) with the interquartile range over steps as the noise, the
scaling efficiency against the first 1-rank setting, and the job's CPU and wall seconds.
"""

from __future__ import annotations

import csv
import json
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import emit, markdown_table, parser, shape_fields, shape_name, versions

# the training config of the workflow's GPU examples; steps comes from --steps
TRAIN = dict(ttt_length=7, epochs=1, batch_tokens=32768, lr=5e-4, warmup_steps=20, grad_clip=0.5, loss_decay=0.8,
             checkpoint_every=10**6, precision="bf16", seed=0)  # fmt: skip
SKIP_STEPS = 5  # the first steps pay for allocation, kernel choice and rank start-up


# ---------------------------------------------------------------- the pure pieces


def default_settings(gpus: int, cores: int) -> list[tuple[int, int]]:
    """1, 2, 4, ... ranks up to the GPUs (2 CPU ranks without a GPU) at every core, then the most
    ranks at half the cores: whether the ranks starve each other of host threads."""
    most = gpus if gpus else min(2, cores)
    ranks = [r for r in (1, 2, 4, 8, 16) if r < most] + [most]
    settings = [(r, cores) for r in ranks] + [(most, max(most, cores // 2))]
    return list(dict.fromkeys(settings))


def rate_summary(tokens_per_s: list[float]) -> tuple[float, float, float]:
    """(median, 25th, 75th percentile) of the per-step rates after the first SKIP_STEPS."""
    rates = tokens_per_s[SKIP_STEPS:] if len(tokens_per_s) > SKIP_STEPS + 1 else tokens_per_s[1:] or tokens_per_s
    if len(rates) == 1:
        return rates[0], rates[0], rates[0]
    q1, _, q3 = statistics.quantiles(rates, n=4)
    return statistics.median(rates), q1, q3


def table_rows(results: list[dict]) -> list[list[str]]:
    one = next((r for r in results if r["ranks"] == 1), None)
    rows = []
    for r in results:
        eff = f"{r['median'] / (r['ranks'] * one['median']):.2f}" if one else "–"
        rows.append([r["ranks"], r["job_threads"], r["threads_per_rank"], f"{r['median']:,.0f} ({r['q1']:,.0f}–{r['q3']:,.0f})",
                     eff, f"{r['cpu_s']:.1f}", f"{r['wall_s']:.1f}"])  # fmt: skip
    return rows


# ---------------------------------------------------------------- the machine


def machine(on_gpu: bool) -> str:
    from specgate.report.provenance import cpu_model

    gpus = f"{torch.cuda.device_count()} × {torch.cuda.get_device_name(0)}, " if on_gpu else ""
    return f"{gpus}{cpu_model()}, {os.cpu_count()} cores"


# ---------------------------------------------------------------- inputs and jobs


def make_inputs(work: Path, shape: dict, total_tokens: int, device: str, batch_tokens: int) -> dict:
    """A random target, random chat-length sequences, their captured states and a draft vocabulary."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from specgate.files import sha256_file
    from specgate.pipeline.capture import capture_hidden_states
    from specgate.pipeline.vocab import build_vocab_stage

    target, tokens, index = work / "target", work / "tokens.safetensors", work / "capture" / "index.json"
    if not (target / "manifest.json").exists():
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**shape)).to(torch.bfloat16)
        model.save_pretrained(target)
        # the keys the capture and vocab stages read from a materialised target's manifest
        manifest = {k: getattr(model.config, k) for k in ("num_hidden_layers", "hidden_size", "vocab_size")}
        manifest["weights"] = {p.name: sha256_file(p) for p in sorted(target.glob("*.safetensors"))}
        (target / "manifest.json").write_text(json.dumps(manifest))
    if not tokens.exists():
        gen = torch.Generator().manual_seed(0)
        longest = min(2048, max(16, batch_tokens // 2))  # chat lengths, but at least two sequences per batch
        lengths, total = [], 0
        while total < total_tokens:
            lengths.append(int(torch.randint(min(200, longest // 2), longest, (1,), generator=gen)))
            total += lengths[-1]
        ids = torch.randint(0, shape["vocab_size"], (total,), generator=gen, dtype=torch.int32)
        offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
        save_file({"input_ids": ids, "loss_mask": torch.ones(total, dtype=torch.uint8), "offsets": offsets}, str(tokens))
    if not index.exists():
        t0 = time.perf_counter()
        capture_hidden_states(str(target), str(tokens), str(index), layers=None, dtype="bfloat16", batch_tokens=65536,
                              shard_tokens=1 << 20, device=device)  # fmt: skip
        print(f"captured in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    vocab = work / "vocab.safetensors"
    if not vocab.exists():
        build_vocab_stage(str(tokens), str(target), str(vocab), str(work / "vocab.json"), min(16384, shape["vocab_size"]))
    return dict(hidden_states=str(index), vocab_path=str(vocab), target_dir=str(target))


def run_setting(work: Path, inputs: dict, ranks: int, job_threads: int, steps: int, train: dict) -> dict:
    from specgate.runtime import THREAD_VARS, rank_threads

    out = work / f"ranks{ranks}_threads{job_threads}"
    shutil.rmtree(out, ignore_errors=True)  # a fresh job: no resume from an earlier call's checkpoints
    job = dict(**inputs, out_weights=str(out / "drafter.safetensors"), out_metrics=str(out / "metrics.csv"),
               steps=steps, **train)  # fmt: skip
    code = ("import json, sys; from specgate.pipeline.train import run_training_job; "
            f"run_training_job({ranks}, **json.loads(sys.argv[1]))")  # fmt: skip
    env = {**os.environ, **{name: str(job_threads) for name in THREAD_VARS}}  # what a Snakemake job of `threads` gets
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out.mkdir(parents=True)
    with open(out / "job.log", "w") as log:
        done = subprocess.run([sys.executable, "-c", code, json.dumps(job)], env=env, cwd=work, stdout=log, stderr=log)
    if done.returncode != 0:
        sys.exit(f"error: training with {ranks} ranks and {job_threads} threads failed; see {out / 'job.log'}")
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(out / "metrics.csv") as f:
        median, q1, q3 = rate_summary([float(r["tokens_per_s"]) for r in csv.DictReader(f)])
    on_gpu = train["device"] != "cpu" and torch.cuda.is_available()
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)  # the job and every rank it started
    res = dict(ranks=ranks, job_threads=job_threads, threads_per_rank=rank_threads(ranks, env, on_gpu), median=median,
               q1=q1, q3=q3, wall_s=wall, cpu_s=cpu)  # fmt: skip
    print(json.dumps(res), file=sys.stderr)
    return res


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("work", type=Path, metavar="WORK_DIR", help="where the synthetic inputs and each job's output go")
    p.add_argument("--out", help="write the Markdown table here too")
    p.add_argument("--tokens", type=int, default=900_000, help="tokens in the synthetic training set (default: %(default)s)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per setting (default: %(default)s)")
    p.add_argument("--settings", help="RANKS:JOB_THREADS,... (default: 1, 2, 4, ... ranks up to the GPUs at every core, "
                                      "then the most ranks at half the cores)")  # fmt: skip
    p.add_argument("--batch-tokens", type=int, default=TRAIN["batch_tokens"], help="global batch (default: %(default)s)")
    p.add_argument("--shape", default="smollm2", help="smollm2 | LlamaConfig kwargs as JSON (default: %(default)s)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu"], help="cpu: CPU ranks even on a GPU host")
    args = p.parse_args(argv)

    on_gpu = args.device != "cpu" and torch.cuda.is_available()
    # without a GPU the job is told "cpu" outright: under "auto" the CPU ranks' Accelerators stay
    # outside the process group, and each rank would train alone
    device = "auto" if on_gpu else "cpu"
    cores = os.cpu_count() or 1
    if args.settings:
        settings = [tuple(map(int, s.split(":"))) for s in args.settings.split(",")]
    else:
        settings = default_settings(torch.cuda.device_count() if on_gpu else 0, cores)
    if on_gpu and max(r for r, _ in settings) > torch.cuda.device_count():
        sys.exit(f"error: a setting asks for more ranks than the {torch.cuda.device_count()} GPUs here")
    shape = shape_fields(args.shape)
    train = {**TRAIN, "batch_tokens": args.batch_tokens, "device": device}
    args.work.mkdir(parents=True, exist_ok=True)
    inputs = make_inputs(args.work, shape, args.tokens, device, args.batch_tokens)
    results = [run_setting(args.work, inputs, ranks, threads, args.steps, train) for ranks, threads in settings]

    shape_label = shape_name(args.shape)
    columns = ["ranks", "job threads", "threads per rank", "tokens/s, all ranks: median (IQR over steps)",
               "scaling efficiency (tok/s ÷ ranks × 1-rank tok/s)", "job CPU s", "wall s"]  # fmt: skip
    text = "\n".join([
        "# Drafter training throughput against ranks and threads per rank",
        "",
        f"`python {shlex.join(sys.argv if argv is None else ['benchmarks/dp_scaling.py', *argv])}` · {machine(on_gpu)} · "
        f"{versions()} · one job per setting, {args.steps} steps each, the first {SKIP_STEPS} not counted",
        "",
        f"Random-init {shape_label} target, {args.tokens:,} synthetic tokens; global batch {args.batch_tokens:,} tokens, "
        f"TTT {TRAIN['ttt_length']}, precision {TRAIN['precision']}.",
        "",
        markdown_table(columns, table_rows(results)),
        "",
    ])  # fmt: skip
    emit(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
