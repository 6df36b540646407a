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
        # target.widen is the widen rule's: changing it keeps this target
        target={k: v for k, v in config["target"].items() if k != "widen"},
        device=config["device"],  # dtype auto: bf16 where this device runs it natively
        code=fingerprint("pipeline.target"),
    script:
        "../scripts/target.py"
