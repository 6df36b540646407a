from specgate.files import stage_log
from specgate.pipeline.target import materialize_target

with stage_log(snakemake.log[0]):
    materialize_target(snakemake.output[0], **snakemake.params.target, device=snakemake.params.device)
