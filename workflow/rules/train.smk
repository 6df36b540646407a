# Checkpoints live in results/train/checkpoints/, not declared, so a killed run resumes.
rule train:
    input:
        capture="results/capture/index.json",
        vocab="results/vocab/vocab.safetensors",
        target="results/target",
    output:
        weights="results/train/drafter.safetensors",
        metrics="results/train/metrics.csv",
    params:
        train=config["train"],
        seed=config["seed"],
        device=config["device"],
        code=fingerprint("train"),
    threads: workflow.cores
    conda:
        "../../envs/specgate.yaml"
    log:
        "results/logs/train.log",
    benchmark:
        "results/benchmarks/train.tsv"
    script:
        "../scripts/train_drafter.py"


rule export:
    input:
        weights="results/train/drafter.safetensors",
        target="results/target",
    output:
        directory("results/drafter"),
    params:
        dtype=config["export"]["dtype"],
        code=fingerprint("export"),
    conda:
        "../../envs/specgate.yaml"
    log:
        "results/logs/export.log",
    benchmark:
        "results/benchmarks/export.tsv"
    script:
        "../scripts/export_drafter.py"


rule acceptance:
    input:
        target="results/target",
        drafter="results/drafter",
        eval="results/data/eval.jsonl",
        metrics="results/train/metrics.csv",
    output:
        "results/acceptance.csv",
    params:
        acceptance=config["acceptance"],
        device=config["device"],
        code=fingerprint("acceptance"),
    threads: workflow.cores
    conda:
        "../../envs/specgate.yaml"
    log:
        "results/logs/acceptance.log",
    benchmark:
        "results/benchmarks/acceptance.tsv"
    script:
        "../scripts/measure_acceptance.py"
