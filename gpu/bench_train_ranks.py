"""Training step time against ranks and host threads per rank, on one multi-GPU host (issue 8).

Run 3 on nvidia-h200-x2 found a 2-rank step (16k tokens per rank) slower than a 1-rank step of
32k tokens, at 12 cores of CPU load. This separates the causes with specgate's own training
code on synthetic captured states of SmolLM2-135M's shape (random weights and tokens: the step
cost does not depend on their values):

    python gpu/bench_train_ranks.py WORK_DIR OUT.md [--tokens 900000] [--steps 30]

Each setting runs `specgate.train.run_training_job` in a fresh process with OMP_NUM_THREADS set
for the whole job, which `runtime.rank_threads` splits among the ranks as the workflow does.
Reported: median tokens/s after the first 5 steps (from metrics.csv) and the job's CPU seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True)  # fmt: skip
TRAIN = dict(ttt_length=7, epochs=1, batch_tokens=32768, lr=5e-4, warmup_ratio=0.03, grad_clip=0.5, loss_decay=0.8,
             checkpoint_every=10**6, precision="bf16", seed=0, device="auto")  # fmt: skip


def make_inputs(work: Path, total_tokens: int) -> dict:
    """A random SmolLM2-shaped target, random chat-length sequences, their captured states, a vocab."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from specgate.capture import capture_hidden_states
    from specgate.files import sha256_file
    from specgate.vocab import build_vocab_stage

    target, tokens, index = work / "target", work / "tokens.safetensors", work / "capture" / "index.json"
    if not (target / "manifest.json").exists():
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**SMOLLM2)).to(torch.bfloat16)
        model.save_pretrained(target)
        manifest = {k: SMOLLM2[k] for k in ("num_hidden_layers", "hidden_size", "vocab_size")}
        manifest["weights"] = {p.name: sha256_file(p) for p in sorted(target.glob("*.safetensors"))}
        (target / "manifest.json").write_text(json.dumps(manifest))
    if not tokens.exists():
        gen = torch.Generator().manual_seed(0)
        lengths, total = [], 0
        while total < total_tokens:
            n = int(torch.randint(200, 2048, (1,), generator=gen))
            lengths.append(n)
            total += n
        ids = torch.randint(0, SMOLLM2["vocab_size"], (total,), generator=gen, dtype=torch.int32)
        offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
        mask = torch.ones(total, dtype=torch.uint8)
        save_file({"input_ids": ids, "loss_mask": mask, "offsets": offsets}, str(tokens))
    if not index.exists():
        t0 = time.perf_counter()
        capture_hidden_states(str(target), str(tokens), str(index), layers=None, dtype="bfloat16",
                              batch_tokens=65536, shard_tokens=1 << 20, device=TRAIN["device"])  # fmt: skip
        print(f"captured in {time.perf_counter() - t0:.1f} s", flush=True)
    vocab = work / "vocab.safetensors"
    if not vocab.exists():
        build_vocab_stage(str(tokens), str(target), str(vocab), str(work / "vocab.json"), 16384)
    return dict(capture_index=str(index), vocab_path=str(vocab), target_dir=str(target))


# what Snakemake sets for a job of `threads` (snakemake/shell.py), which the workflow's ranks inherit;
# a copy of specgate.runtime.THREAD_VARS, because the bench also runs code from before that existed
SNAKEMAKE_THREAD_VARS = ("OMP_NUM_THREADS", "GOTO_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                         "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")  # fmt: skip


def run_setting(work: Path, inputs: dict, ranks: int, job_threads: int, steps: int, snakemake_env: bool, tag: str) -> dict:
    out = work / f"{tag}r{ranks}_t{job_threads}"
    shutil.rmtree(out, ignore_errors=True)  # no resume from an earlier run's checkpoints
    job = dict(**inputs, out_weights=str(out / "drafter.safetensors"), out_metrics=str(out / "metrics.csv"),
               max_steps=steps, **TRAIN)  # fmt: skip
    job_json = json.dumps(json.dumps(job))
    code = f"import json; from specgate.train import run_training_job; run_training_job({ranks}, **json.loads({job_json}))"
    thread_vars = SNAKEMAKE_THREAD_VARS if snakemake_env else ("OMP_NUM_THREADS",)
    env = {**os.environ, **{name: str(job_threads) for name in thread_vars}}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with open(work / f"{out.name}.log", "w") as log:
        subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=work, stdout=sys.stdout, stderr=log)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    import csv

    rows = list(csv.DictReader(open(out / "metrics.csv")))
    # tokens_per_s: the step's tokens over all ranks ÷ rank 0's step time
    rates = sorted(float(r["tokens_per_s"]) for r in rows[5:])
    median = rates[len(rates) // 2]
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    res = dict(ranks=ranks, job_threads=job_threads, threads_per_rank=max(1, job_threads // ranks), steps=len(rows),
               median_tok_s=round(median), wall_s=round(wall, 1), cpu_s=round(cpu, 1))  # fmt: skip
    print(json.dumps(res), flush=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("work", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--tokens", type=int, default=900_000)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--settings", default="1:32,2:32,2:16,2:8,1:4", help="RANKS:JOB_THREADS,...")
    p.add_argument("--batch-tokens", type=int, default=TRAIN["batch_tokens"])
    p.add_argument("--device", default="auto", help="cpu for a smoke run of this script")
    p.add_argument("--snakemake-env", action="store_true", help="set every thread variable Snakemake sets, not only OMP's")
    p.add_argument("--tag", default="", help="prefix of the settings' output dirs")
    args = p.parse_args()
    TRAIN["batch_tokens"] = args.batch_tokens
    TRAIN["device"] = args.device
    args.work.mkdir(parents=True, exist_ok=True)
    inputs = make_inputs(args.work, args.tokens)
    cores = os.cpu_count()
    results = []
    for s in args.settings.split(","):
        ranks, threads = map(int, s.split(":"))
        results.append(run_setting(args.work, inputs, ranks, threads, args.steps, args.snakemake_env, args.tag))
    one = next((r for r in results if r["ranks"] == 1), None)
    gpus = f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}" if torch.cuda.is_available() else "no GPU"
    command = (f"python gpu/bench_train_ranks.py {args.work} {args.out} --tokens {args.tokens} --steps {args.steps} "
               f"--settings {args.settings}{' --snakemake-env' if args.snakemake_env else ''}")  # fmt: skip
    lines = [
        f"# Training throughput against ranks and threads per rank ({gpus}, {cores} cores)",
        "",
        f"`{command}` (PYTHONPATH={os.environ.get('PYTHONPATH', '')})",
        "",
        "| ranks | job threads ÷ ranks (a GPU rank gets at most 4 since the fix) "
        f"| median tokens/s, all ranks (global batch {TRAIN['batch_tokens']:,} tokens) "
        "| scaling efficiency, tok/s ÷ (ranks × the first 1-rank row) | job CPU s | wall s |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        eff = r["median_tok_s"] / (r["ranks"] * one["median_tok_s"]) if one else float("nan")
        lines.append(
            f"| {r['ranks']} | {r['threads_per_rank']} | {r['median_tok_s']:,} | {eff:.2f} | {r['cpu_s']} | {r['wall_s']} |"
        )
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
