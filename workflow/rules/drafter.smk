if not trained():

    # drafter.path: the operator's drafter, checked against the target and linked in
    rule drafter:
        input:
            **drafter_inputs(),
        output:
            **export_outputs(),
        log:
            paths.log("drafter"),
        benchmark:
            paths.stage_times("drafter")
        conda:
            "../../envs/specgate.yaml"
        params:
            path=config["drafter"]["path"],
            code=fingerprint("pipeline.drafter"),
        script:
            "../scripts/drafter.py"
