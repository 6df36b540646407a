from specgate.files import stage_log
from specgate.report.archive import write_archive

with stage_log(snakemake.log[0]):
    inputs = dict(snakemake.input.items())
    extra = [inputs.pop(k) for k in ("report", "provenance", "levels", "recommendation")]
    extra += list(inputs.pop("plots"))
    inputs["bench_summaries"] = list(inputs["bench_summaries"])
    inputs["bench_records"] = list(inputs["bench_records"])
    write_archive(
        snakemake.output[0],
        run_id=snakemake.params.run_id,
        config=snakemake.config,
        report_inputs=inputs,
        extra_files=extra,
        include_drafter=snakemake.params.include_drafter,
        snakefile=snakemake.params.snakefile,
        configfiles=list(snakemake.params.configfiles),
        repo=snakemake.params.repo,
    )
