from specgate.files import stage_log
from specgate.pipeline.train import run_training_job

with stage_log(snakemake.log[0]):
    run_training_job(
        capture_index=snakemake.input.capture,
        vocab_path=snakemake.input.vocab,
        target_dir=snakemake.input.target,
        out_weights=snakemake.output.weights,
        out_metrics=snakemake.output.metrics,
        seed=snakemake.params.seed,
        device=snakemake.params.device,
        **snakemake.params.train,
    )
