from specgate.files import stage_log
from specgate.pipeline.export import export_drafter

with stage_log(snakemake.log[0]):
    export_drafter(
        snakemake.input.weights,
        snakemake.output.drafter,
        snakemake.input.target,
        snakemake.params.dtype,
        widened_target=snakemake.input.get("widened_target"),
        widened_out=snakemake.output.get("widened"),
    )
