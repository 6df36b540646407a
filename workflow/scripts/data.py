from specgate.files import stage_log
from specgate.pipeline.data import prepare_data

with stage_log(snakemake.log[0]):
    prepare_data(
        snakemake.params.sources,
        snakemake.params.filters,
        snakemake.params.seed,
        train_out=snakemake.output.train,
        eval_out=snakemake.output.eval,
        summary_out=snakemake.output.summary,
        replies_replaced=snakemake.params.replies_replaced,
    )
