"""Where every artifact of a run lives: the `results/` tree, named in this one place.

Paths are relative to the directory Snakemake runs in. The rules (`workflow/rules/*.smk`),
the report and the archive take their paths from here, and `rebuild_report` finds an
unpacked archive's files by the same names.
"""

from __future__ import annotations

RESULTS = "results"

TARGET = "results/target"  # HF checkpoint, tokenizer, chat template, manifest.json
DATA_TRAIN = "results/data/train.jsonl"
DATA_EVAL = "results/data/eval.jsonl"
DATA_SUMMARY = "results/data/summary.json"
REGEN_TRAIN = "results/data/train_regen.jsonl"  # the train split with replies written by the target
REGEN_SUMMARY = "results/data/regen_summary.json"
REGEN_SHARDS = "results/data/regen_shards"
TOKENS = "results/tokens/train.safetensors"
TOKENS_SUMMARY = "results/tokens/summary.json"
CAPTURE_INDEX = "results/capture/index.json"  # shards live beside it, in shards/
VOCAB = "results/vocab/vocab.safetensors"
VOCAB_SUMMARY = "results/vocab/summary.json"
TRAIN_WEIGHTS = "results/train/drafter.safetensors"  # checkpoints live beside it, in checkpoints/
TRAIN_METRICS = "results/train/metrics.csv"
DRAFTER = "results/drafter"  # the SGLang-loadable export
ACCEPTANCE = "results/acceptance.csv"  # the served pair: widened target and drafter when target.widen is set
# target.widen: the target and drafter widened to a larger shape, computing the same function.
# Everything up to export uses the narrow target; acceptance, the sweep and the report the widened one.
TARGET_WIDENED = "results/target_widened"
DRAFTER_WIDENED = "results/drafter_widened"
ACCEPTANCE_UNWIDENED = "results/acceptance_unwidened.csv"  # the narrow pair, to check that widening kept acceptance
# One job per variant and round: round r of every variant runs after round r-1 of all of them.
BENCH_RECORDS = "results/bench/{variant}/round{round}.jsonl"
BENCH_SUMMARY = "results/bench/{variant}/round{round}.csv"
BENCH_WORK = "results/bench/work"
REPORT = "results/report.md"
REPORT_DIR = "results/report"
PROVENANCE = "results/report/provenance.json"
PLOT = "results/report/{name}.png"
LEVELS = "results/report/levels.csv"  # per variant and level: median over rounds and its interval
RECOMMENDATION = "results/report/recommendation.json"
ARCHIVE = "results/archive/{run_id}.tar.gz"
LOGS = "results/logs"
STAGE_TIMES = "results/benchmarks"  # Snakemake's `benchmark:` TSV of each job


def log(name: str) -> str:
    return f"{LOGS}/{name}.log"


def stage_times(name: str) -> str:
    return f"{STAGE_TIMES}/{name}.tsv"


def bench_summary(variant: str, round: int) -> str:
    return BENCH_SUMMARY.format(variant=variant, round=round)


def bench_records(variant: str, round: int) -> str:
    return BENCH_RECORDS.format(variant=variant, round=round)


def served_target(widened: bool) -> str:
    return TARGET_WIDENED if widened else TARGET


def served_drafter(widened: bool) -> str:
    return DRAFTER_WIDENED if widened else DRAFTER


def report_inputs(*, regenerate: bool, bench_summaries: list[str], widened: bool = False, trained: bool = True,
                  captured: bool = True) -> dict:  # fmt: skip
    """Every file the report reads, by the name `write_report` takes it under. Each bench summary
    (`<variant>/round<r>.csv`) brings its per-request records (`.jsonl`) beside it. `trained`: the
    drafter was trained here (else it came from drafter.path, and no training stage ran). `captured`:
    hidden states were written to disk (capture.mode offline) rather than computed in the training loop."""
    inputs = {
        "target": served_target(widened),
        "data_summary": DATA_SUMMARY,
        "acceptance": ACCEPTANCE,
        "drafter": served_drafter(widened),
        "bench_summaries": list(bench_summaries),
        "bench_records": [s.removesuffix(".csv") + ".jsonl" for s in bench_summaries],
    }
    if trained:
        inputs |= {"tokens_summary": TOKENS_SUMMARY, "vocab_summary": VOCAB_SUMMARY, "train_metrics": TRAIN_METRICS}
        if captured:
            inputs["capture_index"] = CAPTURE_INDEX
    if regenerate:
        inputs["regen_summary"] = REGEN_SUMMARY
    if widened:
        inputs["acceptance_unwidened"] = ACCEPTANCE_UNWIDENED
    return inputs
