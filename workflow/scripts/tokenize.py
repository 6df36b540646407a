from specgate.pipeline.tokenize import tokenize_dataset
from specgate.files import stage_log

with stage_log(snakemake.log[0]):
    tokenize_dataset(
        snakemake.input.conversations,
        snakemake.input.target,
        snakemake.output.tokens,
        snakemake.params.max_length,
        snakemake.output.summary,
    )
