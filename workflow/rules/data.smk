rule prepare_data:
    output:
        train="results/data/train.jsonl",
        eval="results/data/eval.jsonl",
        summary="results/data/summary.json",
    log:
        "results/logs/prepare_data.log",
    benchmark:
        "results/benchmarks/prepare_data.tsv"
    conda:
        "../../envs/specgate.yaml"
    params:
        sources=config["data"]["sources"],
        filters=config["data"]["filters"],
        seed=config["seed"],
        code=fingerprint("data"),
    script:
        "../scripts/prepare_data.py"


rule regenerate:
    input:
        conversations="results/data/train.jsonl",
        target="results/target",
    output:
        conversations="results/data/train_regen.jsonl",
        summary="results/data/regen_summary.json",
    log:
        "results/logs/regenerate.log",
    benchmark:
        "results/benchmarks/regenerate.tsv"
    conda:
        "../../envs/specgate.yaml"
    threads: workflow.cores
    params:
        regenerate=config["data"]["regenerate"],
        seed=config["seed"],
        device=config["device"],
        code=fingerprint("regenerate"),
    script:
        "../scripts/regenerate.py"


rule tokenize:
    input:
        conversations=training_conversations,
        target="results/target",
    output:
        tokens="results/tokens/train.safetensors",
        summary="results/tokens/summary.json",
    log:
        "results/logs/tokenize.log",
    benchmark:
        "results/benchmarks/tokenize.tsv"
    conda:
        "../../envs/specgate.yaml"
    params:
        max_length=config["tokenize"]["max_length"],
        code=fingerprint("chat"),
    script:
        "../scripts/tokenize_chats.py"
