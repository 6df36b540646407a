from specgate.files import stage_log
from specgate.pipeline.vocab import build_vocab_stage

with stage_log(snakemake.log[0]):
    build_vocab_stage(
        snakemake.input.tokens,
        snakemake.input.target,
        snakemake.output.vocab,
        snakemake.output.summary,
        snakemake.params.draft_vocab_size,
    )
