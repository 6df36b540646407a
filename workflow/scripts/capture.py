from specgate.files import stage_log
from specgate.pipeline.capture import run_capture_job

with stage_log(snakemake.log[0]):
    run_capture_job(
        target_dir=snakemake.input.target,
        tokens_path=snakemake.input.tokens,
        index_out=snakemake.output.index,
        device=snakemake.params.device,
        **snakemake.params.capture,
    )
