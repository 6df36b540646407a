from specgate.files import stage_log
from specgate.pipeline.regenerate import regenerate_stage

with stage_log(snakemake.log[0]):
    regenerate_stage(
        snakemake.input.conversations,
        snakemake.input.target,
        snakemake.output.conversations,
        snakemake.output.summary,
        seed=snakemake.params.seed,
        device=snakemake.params.device,
        **snakemake.params.regenerate,
    )
