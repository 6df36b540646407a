from specgate.files import stage_log
from specgate.pipeline.widen import widen_target

with stage_log(snakemake.log[0]):
    widen_target(snakemake.input[0], snakemake.output[0], snakemake.params.widen)
