"""Thin driver: specgate's own threshold sweep (`specgate.sweep.run_variant`) with engine sglang on the H200.

Loads config/examples/h200-smollm2.yaml through `specgate.config.load_config`, overrides only the
bench keys given on the command line (concurrency, max_tokens, ...), runs one server per variant
through `sweep.run_variant` (variant dicts from `sweep.variant_by_name` via dataclasses.asdict),
then concatenates the per-variant CSVs and writes the report fragment with
`report.sweep_sections(config, summary, plots_dir, out)` plus its PNG plots.

Everything is written to --work (/tmp/sweep: it survives between device calls while the machine
stays warm) and mirrored into --out ($OUT) after every variant, within the device tool's limits
(at most 8 files): sweep_summary.csv, sweep_report.md, the 4 PNGs and sweep_logs.tar.gz (per-variant
JSONL/CSV, server logs, gate evidence, driver log). A variant is skipped, not started, when the
remaining time before --deadline-s cannot hold it; a later call runs it with --variants.

Usage on the device (repo root, after `source gpu/device_env.sh`):
  python3 gpu/run_sweep.py --target /tmp/target --drafter /tmp/sweep/in/drafter \
      --eval /tmp/sweep/in/eval.jsonl --out $OUT --variants nospec,gate_4,always,gate_8 --deadline-s 560
Check without a GPU or server: add --dry-run (prints the config, variants and server commands).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
import shutil
import sys
import tarfile
import time
import traceback
from pathlib import Path

ALL = ["nospec", "always", "gate_4", "gate_8"]
GATE_PATTERNS = re.compile(
    r"\[specgate\]|specgate gate|Switch adaptive runtime state|Loaded plugin|sglang\.srt\.plugins|SPECGATE"
)
PLOTS = ["throughput.png", "latency.png", "envelope.png", "cost_model.png"]

log = logging.getLogger("run_sweep")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="config/examples/h200-smollm2.yaml")
    p.add_argument("--schema", default="workflow/schemas/config.schema.yaml")
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--eval", required=True)
    p.add_argument("--work", default="/tmp/sweep")
    p.add_argument("--out", required=True)
    p.add_argument("--variants", default="nospec,gate_4,always,gate_8", help="run these, in this order")
    p.add_argument("--report-variants", default=",".join(ALL), help="report once all of these have a CSV")
    p.add_argument("--concurrency", default="1,2,4,8,16,32")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--min-requests", type=int, default=16)
    p.add_argument("--requests-per-concurrency", type=int, default=4)
    p.add_argument("--warmup-requests", type=int, default=4)
    p.add_argument("--prompts", type=int, default=192)
    p.add_argument("--deadline-s", type=float, default=None, help="seconds from start: start no variant that cannot end before")
    p.add_argument("--first-need-s", type=float, default=200, help="assumed length of a variant before one was timed")
    p.add_argument("--identity", default="", help="variants that also run the greedy identity schedule")
    p.add_argument("--dry-run", action="store_true")
    return p.parse_args(argv)


def load(args):
    from specgate.config import load_config

    config = load_config(args.config, args.schema)
    bench = config["bench"]
    overrides = {"concurrency": [int(c) for c in args.concurrency.split(",")], "max_tokens": args.max_tokens,
                 "ignore_eos": True, "min_requests": args.min_requests,
                 "requests_per_concurrency": args.requests_per_concurrency,
                 "warmup_requests": args.warmup_requests, "prompts": args.prompts}  # fmt: skip
    names = [n for n in args.variants.split(",") + args.report_variants.split(",") if n]
    for n in names:  # gate_T and steps0_T named on the command line need their thresholds in the config
        kind, _, t = n.partition("_")
        key = {"gate": "thresholds", "steps0": "steps0_thresholds"}.get(kind)
        if key and t.isdigit() and int(t) not in bench[key]:
            overrides[key] = sorted(set(overrides.get(key, bench[key])) | {int(t)})
    changed = {k: (bench[k], v) for k, v in overrides.items() if bench[k] != v}
    bench.update(overrides)
    return config, changed


def identity_hook(work: Path, name: str, sequential_too: bool):
    """on_ready callback: the greedy identity schedule (and, for the reference, one request at a time)."""
    import asyncio

    from specgate.bench_client import identity_schedule, run_schedule

    def run(url, model, prompts):
        jobs = identity_schedule(len(prompts))
        t = time.monotonic()
        out = {"schedule": asyncio.run(run_schedule(url, model, prompts, jobs))}
        if sequential_too:
            out["sequential"] = asyncio.run(run_schedule(url, model, prompts, jobs, sequential=True))
        (work / "identity").mkdir(exist_ok=True)
        (work / "identity" / f"{name}.json").write_text(json.dumps(out))
        log.info("%s: identity schedule done in %.1f s", name, time.monotonic() - t)

    return run


def identity_summary(work: Path) -> dict:
    from specgate.bench_client import compare_outputs

    runs = {f.stem: json.loads(f.read_text()) for f in sorted((work / "identity").glob("*.json"))}
    if "nospec" not in runs:
        return {}
    ref = runs["nospec"]["schedule"]
    out = {f"{n} vs nospec (same schedule)": compare_outputs(ref, r["schedule"]) for n, r in runs.items() if n != "nospec"}
    if "sequential" in runs["nospec"]:
        out["nospec one at a time vs nospec schedule"] = compare_outputs(runs["nospec"]["sequential"], ref)
    return out


def gate_evidence(server_log: Path, max_lines: int = 40) -> str:
    """The plugin / gate lines of one server log, with counts."""
    lines = [ln.rstrip() for ln in server_log.read_text(errors="replace").splitlines() if GATE_PATTERNS.search(ln)]
    switches = [ln for ln in lines if "specgate gate on at" in ln or "specgate gate off at" in ln]
    sglang_switch = [ln for ln in lines if "Switch adaptive runtime state" in ln]
    head = [f"== {server_log.name}: {len(lines)} matching lines, {len(switches)} gate on/off lines, "
            f"{len(sglang_switch)} SGLang 'Switch adaptive runtime state' lines"]  # fmt: skip
    shown = lines if len(lines) <= max_lines else lines[: max_lines // 2] + ["..."] + lines[-max_lines // 2 :]
    return "\n".join(head + shown) + "\n"


def mirror(work: Path, out: Path) -> None:
    """Copy what the device tool brings back into $OUT (at most 8 files)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ["sweep_summary.csv", "sweep_report.md", *PLOTS]:
        if (work / name).exists():
            shutil.copy2(work / name, out / name)
    tmp = out / "sweep_logs.tar.gz.part"
    with tarfile.open(tmp, "w:gz") as tar:
        for f in sorted(work.rglob("*")):
            rel = f.relative_to(work)
            top_level_result = rel.name in ("sweep_summary.csv", "sweep_report.md") or f.suffix == ".png"
            if f.is_file() and rel.parts[0] != "in" and not top_level_result:
                tar.add(f, arcname=str(rel))
    tmp.rename(out / "sweep_logs.tar.gz")


def concat(work: Path, names: list[str]):
    import pandas as pd

    frames = [pd.read_csv(work / "bench" / f"{n}.csv") for n in names if (work / "bench" / f"{n}.csv").exists()]
    return pd.concat(frames, ignore_index=True) if frames else None


def write_report(config: dict, summary, work: Path, header: list[str]) -> None:
    from specgate import report

    out = work / "sweep_report.md"
    parts = report.sweep_sections(config, summary, str(work), str(out))
    text = "\n".join(header + parts) + "\n"
    out.write_text(text)
    log.info("report written: %s (%d chars)", out, len(text))


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    work, out = Path(args.work), Path(args.out)
    (work / "bench").mkdir(parents=True, exist_ok=True)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    handlers = [logging.StreamHandler(sys.stdout), logging.FileHandler(work / "logs" / "driver.log")]
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s %(name)s] %(message)s", datefmt="%H:%M:%S", handlers=handlers)

    from specgate import sweep
    from specgate.launcher import Variant, sglang_command

    config, changed = load(args)
    serve, bench = config["serve"], config["bench"]
    log.info("config %s: serve %s", args.config, json.dumps(serve))
    log.info("bench after overrides %s (changed from the file: %s)", json.dumps(bench), json.dumps(changed))
    names = [n for n in args.variants.split(",") if n]
    variant_dicts = {n: dataclasses.asdict(sweep.variant_by_name(n, bench)) for n in names}
    if args.dry_run:
        for n, v in variant_dicts.items():
            s = sweep.serve_settings(serve, args.target, args.drafter if v["speculative"] else None, "cuda")
            cmd, env = sglang_command(s, Variant(**v), 30000, work / "work")
            print(n, json.dumps(v), "\n   ", " ".join(cmd), "\n    SPECGATE_GATE=", env.get("SPECGATE_GATE"),
                  "SGLANG_PLUGINS=", env.get("SGLANG_PLUGINS"))  # fmt: skip
        return 0

    timings_path = work / "timings.json"
    timings = json.loads(timings_path.read_text()) if timings_path.exists() else {}
    failures = {}
    for n in names:
        elapsed = time.monotonic() - t0
        need = max(timings.values(), default=args.first_need_s) * 1.1
        if args.deadline_s is not None and elapsed + need > args.deadline_s:
            log.warning("SKIP %s: %.0f s elapsed, needs about %.0f s, deadline %.0f s", n, elapsed, need, args.deadline_s)
            continue
        log.info("=== variant %s %s", n, json.dumps(variant_dicts[n]))
        tv = time.monotonic()
        server_log = work / "logs" / f"{n}.server.log"
        stats_dir = work / "stats" / n
        stats_dir.mkdir(parents=True, exist_ok=True)
        serve_n = {**serve, "env": {**serve["env"], "SPECGATE_STATS_DIR": str(stats_dir)}}
        on_ready = identity_hook(work, n, n == "nospec") if n in args.identity.split(",") else None
        try:
            summary = sweep.run_variant(
                variant_dicts[n], engine=serve["engine"], serve=serve_n, bench=bench, target=args.target,
                drafter=args.drafter, eval_jsonl=args.eval, records_out=str(work / "bench" / f"{n}.jsonl"),
                summary_out=str(work / "bench" / f"{n}.csv"), server_log=str(server_log),
                work_dir=str(work / "work"), device=config["device"], seed=config["seed"], on_ready=on_ready)  # fmt: skip
            cols = ["concurrency", "output_throughput", "median_ttft_ms", "median_itl_ms", "accept_length", "failed"]
            log.info("%s done in %.1f s\n%s", n, time.monotonic() - tv, summary[cols].to_string(index=False))
            timings[n] = time.monotonic() - tv
        except BaseException as e:  # noqa: BLE001 - keep going: later variants and the logs still matter
            failures[n] = f"{type(e).__name__}: {e}"
            log.error("%s FAILED after %.1f s:\n%s", n, time.monotonic() - tv, traceback.format_exc())
            if isinstance(e, KeyboardInterrupt):
                raise
        timings_path.write_text(json.dumps(timings, indent=1))
        for f in stats_dir.glob("gate_stats_*.json"):
            log.info("%s gate stats: %s", n, f.read_text())
            (work / "logs" / f"gate_stats_{n}.json").write_text(f.read_text())
        if (work / "identity").exists():
            ident = identity_summary(work)
            (work / "logs" / "identity_summary.json").write_text(json.dumps(ident, indent=1))
            log.info("identity: %s", json.dumps({k: (v["identical"], v["requests"]) for k, v in ident.items()}))
        if server_log.exists():
            ev = gate_evidence(server_log)
            with open(work / "logs" / "gate_evidence.txt", "a") as f:
                f.write(ev)
            print(ev, flush=True)
        summary_all = concat(work, args.report_variants.split(","))
        if summary_all is not None:
            summary_all.to_csv(work / "sweep_summary.csv", index=False)
        mirror(work, out)

    wanted = args.report_variants.split(",")
    summary_all = concat(work, wanted)
    have = set(summary_all.variant) if summary_all is not None else set()
    if summary_all is not None:
        summary_all.to_csv(work / "sweep_summary.csv", index=False)
    if set(wanted) <= have:
        header = ["# Threshold sweep on one H200: SGLang 0.5.15 + specgate gate plugin", "",
                  f"Generated on the device by `gpu/run_sweep.py` through `specgate.sweep.run_variant` and "
                  f"`specgate.report.sweep_sections`; config `{args.config}` with bench overrides "
                  f"{json.dumps({k: v[1] for k, v in changed.items()})}. Variant wall times (server start, levels, stop), s: "
                  f"{json.dumps({k: round(v, 1) for k, v in timings.items()})}."]  # fmt: skip
        try:
            write_report(config, summary_all, work, header)
        except Exception:  # noqa: BLE001
            log.error("report FAILED:\n%s", traceback.format_exc())
            failures["report"] = traceback.format_exc(limit=3)
    else:
        log.info("report waits for %s (have %s)", sorted(set(wanted) - have), sorted(have))
    mirror(work, out)
    log.info("driver done in %.1f s; failures: %s", time.monotonic() - t0, json.dumps(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
