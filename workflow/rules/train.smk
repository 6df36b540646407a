# Checkpoints live in results/train/checkpoints/, not declared, so a killed run resumes.
# capture.mode online: the input is the tokenized set, and the target runs in the training loop.
rule train:
    input:
        hidden_states=train_hidden_states,
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
        capture=train_capture_settings(),
        seed=config["seed"],
        device=config["device"],
        code=fingerprint("pipeline.train"),
    script:
        "../scripts/train.py"
