from specgate.files import stage_log
from specgate.pipeline.acceptance import measure_acceptance

with stage_log(snakemake.log[0]):
    measure_acceptance(
        snakemake.input.target,
        snakemake.input.drafter,
        snakemake.input.eval,
        snakemake.input.get("metrics"),  # absent for a drafter taken from drafter.path
        snakemake.output[0],
        device=snakemake.params.device,
        **snakemake.params.acceptance,
    )
