from specgate.files import stage_log
from specgate.sweep.bench import run_variant

with stage_log(snakemake.log.main):
    run_variant(
        snakemake.params.variant,
        engine=snakemake.params.engine,
        serve=snakemake.params.serve,
        bench=snakemake.params.bench,
        target=snakemake.input.target,
        drafter=snakemake.input.get("drafter"),
        eval_jsonl=snakemake.input.eval,
        records_out=snakemake.output.records,
        summary_out=snakemake.output.summary,
        server_log=snakemake.log.server,
        work_dir=snakemake.params.work_dir,
        device=snakemake.params.device,
        seed=snakemake.params.seed,
        round=snakemake.params.round,
    )
