rule data:
    output:
        train=paths.DATA_TRAIN,
        eval=paths.DATA_EVAL,
        summary=paths.DATA_SUMMARY,
    log:
        paths.log("data"),
    benchmark:
        paths.stage_times("data")
    conda:
        "../../envs/specgate.yaml"
    params:
        sources=config["data"]["sources"],
        filters=config["data"]["filters"],
        seed=config["seed"],
        code=fingerprint("pipeline.data"),
    script:
        "../scripts/data.py"
