if trained():

    rule export:
        input:
            unpack(export_inputs),
        output:
            **export_outputs(),
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
