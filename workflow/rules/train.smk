# Checkpoints live in results/train/checkpoints/, not declared, so a killed run resumes.
rule train:
    input:
        capture="results/capture/index.json",
        vocab="results/vocab/vocab.safetensors",
        target="results/target",
    output:
        weights="results/train/drafter.safetensors",
        metrics="results/train/metrics.csv",
    log:
        "results/logs/train.log",
    benchmark:
        "results/benchmarks/train.tsv"
    conda:
        "../../envs/specgate.yaml"
    threads: workflow.cores
    params:
        train=config["train"],
        seed=config["seed"],
        device=config["device"],
        code=fingerprint("train"),
    script:
        "../scripts/train_drafter.py"


rule export:
    input:
        weights="results/train/drafter.safetensors",
        target="results/target",
    output:
        directory("results/drafter"),
    log:
        "results/logs/export.log",
    benchmark:
        "results/benchmarks/export.tsv"
    conda:
        "../../envs/specgate.yaml"
    params:
        dtype=config["export"]["dtype"],
        code=fingerprint("export"),
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
    log:
        "results/logs/acceptance.log",
    benchmark:
        "results/benchmarks/acceptance.tsv"
    conda:
        "../../envs/specgate.yaml"
    threads: workflow.cores
    params:
        acceptance=config["acceptance"],
        device=config["device"],
        code=fingerprint("acceptance"),
    script:
        "../scripts/measure_acceptance.py"
