rule tokenize:
    input:
        conversations=training_conversations,
        target=paths.TARGET,
    output:
        tokens=paths.TOKENS,
        summary=paths.TOKENS_SUMMARY,
    log:
        paths.log("tokenize"),
    benchmark:
        paths.stage_times("tokenize")
    conda:
        "../../envs/specgate.yaml"
    params:
        max_length=config["tokenize"]["max_length"],
        code=fingerprint("pipeline.tokenize"),
    script:
        "../scripts/tokenize.py"
