"""Does the recommendation survive a rerun? Rerun the threshold sweep N times from the same trained drafter.

Each run is `snakemake --cores all results/report.md --forcerun bench [--configfile FILE]` in the
repository root: only the bench jobs (every variant, every round) and the report rerun. After each
run the script reads `results/report/recommendation.json` and `results/report/levels.csv`, and keeps
a copy of both and of the report under `--keep DIR`. The table gives, per run: the verdict, the pick,
the gates within noise of the best, the pick's envelope efficiency with its interval, always-on ÷
no-spec at the lowest concurrency (medians), and the sweep's wall time. Below it: in how many runs
the modal pick recurs, and in how many the within-noise set is the modal one or contains the modal pick.

Run it after one full run of the config, so that everything before the sweep is built.
"""

from __future__ import annotations

import collections
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
from common import emit, machine, markdown_table, parser, versions

REPO = Path(__file__).resolve().parents[1]


def one_run(configfile: str | None, cores: str) -> float:
    cmd = [sys.executable, "-m", "snakemake", "--cores", cores, "results/report.md", "--forcerun", "bench"]
    if configfile:
        cmd += ["--configfile", configfile]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return time.perf_counter() - t0


def row(run: int, rec: dict, levels: pd.DataFrame, seconds: float) -> list:
    c = levels.concurrency.min()
    at = levels[levels.concurrency == c].set_index("variant")
    gain = at.at["always", "output_throughput"] / at.at["nospec", "output_throughput"]
    env = rec["envelope"][rec["pick"]] if rec.get("pick") else None
    return [run, rec["verdict"], rec["pick"], ", ".join(rec["within_noise"]),
            f"{env[0]:.3f} [{env[1]:.3f}–{env[2]:.3f}]" if env else "-", f"×{gain:.2f}", f"{seconds / 60:.1f}"]  # fmt: skip


def agreement(recs: list[dict]) -> str:
    picks = collections.Counter(r["pick"] for r in recs)
    modal, same = picks.most_common(1)[0]
    sets = collections.Counter(tuple(r["within_noise"]) for r in recs)
    modal_set, same_set = sets.most_common(1)[0]
    containing = sum(modal in r["within_noise"] for r in recs)
    return (
        f"The modal pick, {modal}, recurs in {same} of {len(recs)} runs. The modal within-noise set, "
        f"{{{', '.join(modal_set)}}}, recurs in {same_set} of {len(recs)}; {containing} of {len(recs)} runs name "
        f"{modal} within noise of their best gate."
    )


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--configfile", default=None, help="a workflow config; default: config/config.yaml")
    ap.add_argument("--cores", default="all")
    ap.add_argument("--keep", default="reproducibility", help="folder for each run's report, levels and recommendation")
    ap.add_argument("--out", default="reproducibility.md")
    ap.add_argument(
        "--current-as-first",
        type=float,
        metavar="SECONDS",
        default=None,
        help="count the sweep already in results/ as run 1, with this wall time, and rerun --runs - 1 more",
    )
    args = ap.parse_args(argv)
    keep = Path(args.keep)
    keep.mkdir(parents=True, exist_ok=True)
    rows, recs = [], []
    for run in range(1, args.runs + 1):
        first = run == 1 and args.current_as_first is not None
        seconds = args.current_as_first if first else one_run(args.configfile, args.cores)
        rec = json.loads((REPO / "results/report/recommendation.json").read_text())
        levels = pd.read_csv(REPO / "results/report/levels.csv")
        for name in ("report.md", "report/recommendation.json", "report/levels.csv"):
            shutil.copy(REPO / "results" / name, keep / f"run{run}-{Path(name).name}")
        recs.append(rec)
        rows.append(row(run, rec, levels, seconds))
        print(rows[-1], flush=True)
    table = markdown_table(["run", "verdict", "pick", "within noise of the best", "pick's envelope efficiency [90%]",
                            "always ÷ no-spec, lowest c", "sweep + report, min"], rows)  # fmt: skip
    command = shlex.join(["python", "benchmarks/reproducibility.py", *(sys.argv[1:] if argv is None else argv)])
    emit("\n".join(["# The recommendation over reruns of the sweep", "", f"`{command}` · {machine('cpu')} · {versions()}",
                     "", table, "", agreement(recs), ""]), args.out)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
