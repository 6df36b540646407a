rule acceptance:
    input:
        target=served_target(),
        drafter=served_drafter(),
        eval=paths.DATA_EVAL,
        metrics=paths.TRAIN_METRICS,
    output:
        paths.ACCEPTANCE,
    log:
        paths.log("acceptance"),
    benchmark:
        paths.stage_times("acceptance")
    conda:
        "../../envs/specgate.yaml"
    threads: all_cores
    params:
        acceptance=config["acceptance"],
        device=config["device"],
        code=fingerprint("pipeline.acceptance"),
    script:
        "../scripts/acceptance.py"


# target.widen: the same measurement on the narrow target and drafter. The report sets the two side
# by side: widening changes the cost of a step, and should change no accepted token.
use rule acceptance as acceptance_unwidened with:
    input:
        target=paths.TARGET,
        drafter=paths.DRAFTER,
        eval=paths.DATA_EVAL,
        metrics=paths.TRAIN_METRICS,
    output:
        paths.ACCEPTANCE_UNWIDENED,
    log:
        paths.log("acceptance_unwidened"),
    benchmark:
        paths.stage_times("acceptance_unwidened")
