rule vocab:
    input:
        tokens=paths.TOKENS,
        target=paths.TARGET,
    output:
        vocab=paths.VOCAB,
        summary=paths.VOCAB_SUMMARY,
    log:
        paths.log("vocab"),
    benchmark:
        paths.stage_times("vocab")
    conda:
        "../../envs/specgate.yaml"
    params:
        draft_vocab_size=config["vocab"]["draft_vocab_size"],
        code=fingerprint("pipeline.vocab"),
    script:
        "../scripts/vocab.py"
