from specgate.files import stage_log
from specgate.pipeline.tokenize import tokenize_dataset

with stage_log(snakemake.log[0]):
    tokenize_dataset(
        snakemake.input.conversations,
        snakemake.input.target,
        snakemake.output.tokens,
        snakemake.params.max_length,
        snakemake.output.summary,
        snakemake.params.mask_end_of_turn,
    )
