from pathlib import Path

from specgate.files import stage_log
from specgate.report.report import build_report

with stage_log(snakemake.log[0]):
    inputs = dict(snakemake.input.items())
    inputs["bench_summaries"] = list(snakemake.input.bench_summaries)
    inputs["bench_records"] = list(snakemake.input.bench_records)
    build_report(
        snakemake.output.report,
        provenance_out=snakemake.output.provenance,
        levels_out=snakemake.output.levels,
        recommendation_out=snakemake.output.recommendation,
        repo=snakemake.params.repo,
        config=snakemake.config,
        plots_dir=str(Path(snakemake.output.plots[0]).parent),
        **inputs,
    )
