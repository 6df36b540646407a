from specgate.files import stage_log
from specgate.pipeline.train import run_training_job

with stage_log(snakemake.log[0]):
    run_training_job(
        hidden_states=snakemake.input.hidden_states,
        capture=snakemake.params.capture,
        vocab_path=snakemake.input.vocab,
        target_dir=snakemake.input.target,
        out_weights=snakemake.output.weights,
        out_metrics=snakemake.output.metrics,
        seed=snakemake.params.seed,
        device=snakemake.params.device,
        **snakemake.params.train,
    )
