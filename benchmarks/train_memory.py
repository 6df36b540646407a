"""Drafter training's peak resident memory and speed against the heap policy: blocks of at least
`--mmap-above` MiB get their own mmap (returned when freed), smaller ones stay in glibc's heap.

    python benchmarks/train_memory.py --results results --configfile config/config.yaml --mmap-above 1024,16,4

Reads a finished workflow's results (the capture index, the draft vocabulary, the target) and the training
settings of its config. Each run is a fresh process running specgate's own training job (as the train
rule does) for the config's whole step budget, or `--steps`; the thresholds take turns, `--repeats` times.
A run's speed is the median tokens/s of its steps after the first 5, its memory the process's peak RSS.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import emit, markdown_table, parser, versions

SKIP_STEPS = 5  # allocation and the first batches' one-time costs
RUN = """
import json, resource, sys
import specgate.pipeline.train as train
train.TRAIN_MMAP_ABOVE = int(sys.argv[2]) << 20
train.run_training_job(1, **json.loads(sys.argv[1]))
print("peak_rss_kb", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def run_once(work: Path, mmap_above_mb: int, repeat: int, results: Path, train: dict, device: str) -> dict:
    out = work / f"mmap{mmap_above_mb}-{repeat}"
    shutil.rmtree(out, ignore_errors=True)  # no resume from an earlier run's checkpoints
    out.mkdir(parents=True)
    job = dict(hidden_states=str(results / "capture/index.json"), vocab_path=str(results / "vocab/vocab.safetensors"),
               target_dir=str(results / "target"), out_weights=str(out / "drafter.safetensors"),
               out_metrics=str(out / "metrics.csv"), device=device, **train)  # fmt: skip
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", RUN, json.dumps(job), str(mmap_above_mb)], cwd=work,
                          capture_output=True, text=True)  # fmt: skip
    (out / "job.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"run with --mmap-above {mmap_above_mb} failed: see {out / 'job.log'}")
    peak_kb = int(done.stdout.split("peak_rss_kb")[-1])
    with open(out / "metrics.csv") as f:
        rates = [float(r["tokens_per_s"]) for r in csv.DictReader(f)][SKIP_STEPS:]
    return {"mmap_above": mmap_above_mb, "rate": statistics.median(rates), "wall_s": time.perf_counter() - t0,
            "peak_rss_gb": peak_kb / 2**20, "steps": len(rates) + SKIP_STEPS}  # fmt: skip


def main(argv=None) -> None:
    from specgate.config import load_config

    p = parser(__doc__)
    p.add_argument("--results", default="results", help="a finished workflow's results folder (offline capture)")
    p.add_argument("--configfile", default="config/config.yaml", help="the config that built it (train settings)")
    p.add_argument("--mmap-above", default="1024,16", help="thresholds in MiB, comma-separated")
    p.add_argument("--steps", type=int, help="optimizer steps per run (default: the config's whole budget)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--work-dir", default="train-memory-work")
    p.add_argument("--out", help="also write the page here")
    a = p.parse_args(argv)
    results, work = Path(a.results).resolve(), Path(a.work_dir).resolve()
    if not (results / "capture/index.json").exists():
        raise SystemExit(f"train_memory.py: no {results / 'capture/index.json'}: run the workflow up to its capture first")
    config = load_config(a.configfile)
    train = {k: v for k, v in config["train"].items() if k != "num_processes"} | {
        "checkpoint_every": 10**6, "seed": config["seed"]}
    if a.steps:
        train["steps"] = a.steps
    thresholds = [int(x) for x in a.mmap_above.split(",")]
    runs = [run_once(work, mb, r, results, train, config["device"]) for r in range(a.repeats) for mb in thresholds]
    base = statistics.median(r["rate"] for r in runs if r["mmap_above"] == thresholds[0])
    rows = []
    for mb in thresholds:
        mine = [r for r in runs if r["mmap_above"] == mb]
        rates, peaks = [r["rate"] for r in mine], [r["peak_rss_gb"] for r in mine]
        rows.append([f"{mb:,} MiB", mine[0]["steps"], f"{statistics.median(rates):,.0f} ({min(rates):,.0f}–{max(rates):,.0f})",
                     f"{statistics.median(rates) / base:.2f}", f"{max(peaks):.2f} ({min(peaks):.2f}–{max(peaks):.2f})",
                     f"{statistics.median(r['wall_s'] for r in mine):.0f}"])  # fmt: skip
    text = "\n".join([
        f"`python benchmarks/train_memory.py --results {a.results} --configfile {a.configfile} --mmap-above "
        f"{a.mmap_above}{f' --steps {a.steps}' if a.steps else ''} --repeats {a.repeats}`", "",
        f"{os.cpu_count()} CPU cores; {versions()}; train.batch_tokens {train['batch_tokens']}, precision "
        f"{train['precision']}; {a.repeats} run(s) of each threshold, taking turns.", "",
        markdown_table(["own mmap from", "steps", "train tokens/s, median (range)", "÷ first row", "peak RSS GB, max (range)",
                        "run wall s"], rows),
    ])  # fmt: skip
    emit(text, a.out)


if __name__ == "__main__":
    main()
