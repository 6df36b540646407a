rule acceptance:
    input:
        unpack(acceptance_inputs),
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
        unpack(lambda wildcards: acceptance_inputs(wildcards, wide=False)),
    output:
        paths.ACCEPTANCE_UNWIDENED,
    log:
        paths.log("acceptance_unwidened"),
    benchmark:
        paths.stage_times("acceptance_unwidened")
