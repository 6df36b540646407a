rule target:
    output:
        directory(paths.TARGET),
    log:
        paths.log("target"),
    benchmark:
        paths.stage_times("target")
    conda:
        "../../envs/specgate.yaml"
    threads: all_cores
    params:
        target=config["target"],
        code=fingerprint("pipeline.target"),
    script:
        "../scripts/target.py"
