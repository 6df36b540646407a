"""A reproducible archive of one experiment, and the report rebuilt from it.

`results/archive/<run-id>.tar.gz` holds, under `<run-id>/`:
  results/...        every file the report reads (summaries, metrics CSVs, bench CSV and JSONL,
                     Snakemake benchmark TSVs, the target's manifest, the drafter's config and,
                     if configured, its weights), the report, its plots and provenance.json
  meta/config.yaml   the resolved config (defaults filled in)
  meta/pip-freeze.txt, meta/detailed-summary.tsv (`snakemake --detailed-summary`),
  meta/git.txt (commit, dirty flag) and meta/git.diff when the tree is dirty.

`rebuild_report(archive, dest)` unpacks it and regenerates the report from those files
alone, with the same relative paths, so the rebuilt tables equal the archived ones.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import yaml

from specgate import layout
from specgate.files import atomic_path, read_json

# Report inputs that are directories: only these files inside them are needed to rebuild.
_DIR_FILES = {"target": ["manifest.json"], "drafter": ["config.json", "origin.json"]}  # those that exist


def _run(cmd: list[str], cwd: str | None = None) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    return r.stdout if r.returncode == 0 else f"# {' '.join(cmd)} failed ({r.returncode})\n{r.stderr[-2000:]}"


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0
    tar.addfile(info, io.BytesIO(data))


def write_archive(out: str, *, run_id: str, config: dict, report_inputs: dict, extra_files: list[str],
                  include_drafter: bool, snakefile: str, configfiles: list[str], repo: str) -> None:  # fmt: skip
    files: list[str] = list(extra_files)
    for key, value in report_inputs.items():
        for path in value if isinstance(value, list) else [value]:
            if key in _DIR_FILES:
                names = _DIR_FILES[key]
                if key == "drafter" and include_drafter:
                    names = sorted(os.listdir(path))
                files += [str(Path(path) / n) for n in names if (Path(path) / n).exists()]
            else:
                files.append(path)
    bench_dir = Path(layout.STAGE_TIMES)
    files += sorted(str(p) for p in bench_dir.glob("*.tsv"))

    config_args = [a for f in configfiles for a in ("--configfile", f)]
    summary = _run([sys.executable, "-m", "snakemake", "-s", snakefile, *config_args, "--detailed-summary", "--nolock",
                    "--cores", "1"])  # fmt: skip
    freeze = _run([sys.executable, "-m", "pip", "freeze"])
    commit = _run(["git", "-C", repo, "rev-parse", "HEAD"]).strip()
    status = _run(["git", "-C", repo, "status", "--porcelain", "--untracked-files=no"]).strip()
    with atomic_path(out) as tmp, tarfile.open(tmp, "w:gz", dereference=True) as tar:  # links: the files
        for f in sorted(set(files)):
            tar.add(f, arcname=f"{run_id}/{f}", recursive=False)
        meta = f"{run_id}/meta"
        _add_bytes(tar, f"{meta}/config.yaml", yaml.safe_dump(config, sort_keys=False).encode())
        _add_bytes(tar, f"{meta}/pip-freeze.txt", freeze.encode())
        _add_bytes(tar, f"{meta}/detailed-summary.tsv", summary.encode())
        _add_bytes(tar, f"{meta}/git.txt", f"commit {commit}\ndirty {bool(status)}\n{status}\n".encode())
        if status:
            _add_bytes(tar, f"{meta}/git.diff", _run(["git", "-C", repo, "diff", "HEAD"]).encode())


def rebuild_report(archive: str, dest: str) -> Path:
    """Unpack `archive` under `dest` and rewrite its report from its own files; returns the report path.

    The archived report is kept beside it as results/report.archived.md for comparison.
    """
    from specgate.report.report import write_report

    dest = Path(dest)
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
        run_id = tar.getnames()[0].split("/")[0]
    root = dest / run_id
    config = yaml.safe_load((root / "meta/config.yaml").read_text())
    provenance = read_json(root / layout.PROVENANCE)
    (root / layout.REPORT).rename(root / layout.REPORT.replace(".md", ".archived.md"))
    bench = sorted(str(p.relative_to(root)) for p in (root / layout.RESULTS / "bench").glob("*/round*.csv"))
    inputs = layout.report_inputs(regenerate=(root / layout.REGEN_SUMMARY).exists(), bench_summaries=bench,
                                  widened=(root / layout.TARGET_WIDENED).exists(),
                                  trained=(root / layout.TRAIN_METRICS).exists())  # fmt: skip
    cwd = os.getcwd()
    os.chdir(root)  # the report quotes relative paths: rebuild with the same ones
    try:
        write_report(layout.REPORT, config=config, provenance=provenance, stage_times_dir=layout.STAGE_TIMES,
                     plots_dir=layout.REPORT_DIR, levels_out=layout.LEVELS, recommendation_out=layout.RECOMMENDATION,
                     **inputs)
    finally:
        os.chdir(cwd)
    return root / layout.REPORT
