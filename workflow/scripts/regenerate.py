from specgate.files import stage_log
from specgate.pipeline.regenerate import run_regenerate_job

with stage_log(snakemake.log[0]):
    run_regenerate_job(
        snakemake.input.conversations,
        snakemake.input.target,
        snakemake.output.conversations,
        snakemake.output.summary,
        max_prompt_tokens=snakemake.params.max_prompt_tokens,
        seed=snakemake.params.seed,
        device=snakemake.params.device,
        **snakemake.params.regenerate,
    )
