# Checkpoints live in results/train/checkpoints/, not declared, so a killed run resumes.
rule train:
    input:
        capture=paths.CAPTURE_INDEX,
        vocab=paths.VOCAB,
        target=paths.TARGET,
    output:
        weights=paths.TRAIN_WEIGHTS,
        metrics=paths.TRAIN_METRICS,
    log:
        paths.log("train"),
    benchmark:
        paths.stage_times("train")
    conda:
        "../../envs/specgate.yaml"
    threads: all_cores
    params:
        train=config["train"],
        seed=config["seed"],
        device=config["device"],
        code=fingerprint("pipeline.train"),
    script:
        "../scripts/train.py"
