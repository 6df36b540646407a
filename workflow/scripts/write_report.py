from specgate.files import stage_log
from specgate.report import write_report

with stage_log(snakemake.log[0]):
    write_report(
        snakemake.output.report,
        config=snakemake.config,
        repo=snakemake.params.repo,
        **dict(snakemake.input.items()),
    )
