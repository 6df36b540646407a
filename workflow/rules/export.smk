rule export:
    input:
        weights=paths.TRAIN_WEIGHTS,
        target=paths.TARGET,
    output:
        directory(paths.DRAFTER),
    log:
        paths.log("export"),
    benchmark:
        paths.stage_times("export")
    conda:
        "../../envs/specgate.yaml"
    params:
        dtype=config["export"]["dtype"],
        code=fingerprint("pipeline.export"),
    script:
        "../scripts/export.py"
