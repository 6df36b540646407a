"""Drafter training with hidden states read from the capture's shards (offline) against computed by the
target in the training loop (online): tokens/s at the same batch, peak memory, and the disk each uses.

    python benchmarks/online_capture.py --results results --steps 30 --repeats 2 --out online-capture.md

Reads a finished workflow's results (the tokenized set, the capture index, the draft vocabulary and
the target) and the training settings of its config (`--configfile`). Each run is a fresh process
running specgate's own training job (`run_training_job`, as the train rule does) for `--steps` steps;
the modes alternate (offline, online, offline, ...) so drift of the machine falls on both. A run's
rate is the median tokens/s of its steps after the first 5; the table gives the median over runs,
with the range of the runs as the noise.
"""

from __future__ import annotations

import csv
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml
from common import emit, markdown_table, parser, versions

SKIP_STEPS = 5  # allocation and the first batches' one-time costs


def run_once(work: Path, mode: str, repeat: int, results: Path, train: dict, capture: dict, device: str) -> dict:
    out = work / f"{mode}{repeat}"
    shutil.rmtree(out, ignore_errors=True)  # no resume from an earlier run's checkpoints
    out.mkdir(parents=True)
    source = results / ("capture/index.json" if mode == "offline" else "tokens/train.safetensors")
    job = dict(hidden_states=str(source), vocab_path=str(results / "vocab/vocab.safetensors"),
               target_dir=str(results / "target"), out_weights=str(out / "drafter.safetensors"),
               out_metrics=str(out / "metrics.csv"), device=device, **train,
               capture={"mode": mode, "layers": capture["layers"], "dtype": capture["dtype"]})  # fmt: skip
    code = ("import json, sys; from specgate.pipeline.train import run_training_job; "
            "run_training_job(1, **json.loads(sys.argv[1]))")  # fmt: skip
    t0 = time.perf_counter()
    with open(out / "job.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", code, json.dumps(job)], cwd=work, stdout=log, stderr=log)
        _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{mode} run failed: see {out / 'job.log'}")
    with open(out / "metrics.csv") as f:
        rates = [float(r["tokens_per_s"]) for r in csv.DictReader(f)][SKIP_STEPS:]
    return {"mode": mode, "rate": statistics.median(rates), "wall_s": time.perf_counter() - t0,
            "peak_rss_gb": usage.ru_maxrss / 2**20}  # fmt: skip


def main(argv=None) -> None:
    p = parser(__doc__)
    p.add_argument("--results", default="results", help="a finished workflow's results folder")
    p.add_argument("--configfile", default="config/config.yaml", help="the config that built it (train settings)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--work-dir", default="online-capture-work")
    p.add_argument("--out", help="also write the page here")
    a = p.parse_args(argv)
    results, work = Path(a.results).resolve(), Path(a.work_dir).resolve()
    config = yaml.safe_load(Path(a.configfile).read_text())
    train = {k: v for k, v in config["train"].items() if k != "num_processes"} | {
        "steps": a.steps, "checkpoint_every": 10**6, "seed": config.get("seed", 0)}
    device = config.get("device", "auto")
    runs = [run_once(work, mode, r, results, train, config["capture"], device)
            for r in range(a.repeats) for mode in ("offline", "online")]  # fmt: skip
    index = json.loads((results / "capture/index.json").read_text())
    disk = {"offline": index["bytes"], "online": 0}
    rows, median = [], {}
    for mode in ("offline", "online"):
        mine = [r for r in runs if r["mode"] == mode]
        rates = [r["rate"] for r in mine]
        median[mode] = statistics.median(rates)
        rows.append([mode, f"{median[mode]:,.0f} ({min(rates):,.0f}–{max(rates):,.0f})",
                     f"{max(r['peak_rss_gb'] for r in mine):.2f}", f"{disk[mode] / 2**30:.2f} GiB",
                     f"{statistics.median(r['wall_s'] for r in mine):.0f}"])  # fmt: skip
    on_gpu = torch.cuda.is_available()
    where = torch.cuda.get_device_name(0) if on_gpu else f"{os.cpu_count()} CPU cores"
    text = "\n".join([
        f"`python benchmarks/online_capture.py --results {a.results} --configfile {a.configfile} --steps {a.steps} "
        f"--repeats {a.repeats}`", "",
        f"{where}; {versions()}; {index['tokens']:,} captured tokens, train.batch_tokens {train['batch_tokens']}, "
        f"precision {train['precision']}; {a.repeats} runs of each mode, alternating.", "",
        markdown_table(["hidden states", "train tokens/s, median (range of runs)", "peak RSS GB", "disk for states",
                        "run wall s"], rows),
        "", f"online ÷ offline tokens/s: {median['online'] / median['offline']:.2f}",
    ])  # fmt: skip
    emit(text, a.out)


if __name__ == "__main__":
    main()
