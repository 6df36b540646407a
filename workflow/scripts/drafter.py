from specgate.files import stage_log
from specgate.pipeline.drafter import take_drafter

with stage_log(snakemake.log[0]):
    take_drafter(
        snakemake.params.path,
        snakemake.output.drafter,
        snakemake.input.target,
        widened_target=snakemake.input.get("widened_target"),
        widened_out=snakemake.output.get("widened"),
    )
