# target.widen: the target at a larger shape, computing the same function (specgate.model.widen).
# Served in place of the target; data, capture and training keep the target as it is.
rule widen:
    input:
        paths.TARGET,
    output:
        directory(paths.TARGET_WIDENED),
    log:
        paths.log("widen"),
    benchmark:
        paths.stage_times("widen")
    conda:
        "../../envs/specgate.yaml"
    params:
        widen=config["target"]["widen"],
        code=fingerprint("pipeline.widen"),
    script:
        "../scripts/widen.py"
