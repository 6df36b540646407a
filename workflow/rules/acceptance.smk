rule acceptance:
    input:
        target=paths.TARGET,
        drafter=paths.DRAFTER,
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
