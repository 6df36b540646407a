# Shards live beside the index in results/capture/shards/. Only the index is the
# declared output, so Snakemake does not delete finished shards of a killed run and
# a rerun resumes at the first missing shard.
rule capture:
    input:
        tokens="results/tokens/train.safetensors",
        target="results/target",
    output:
        index="results/capture/index.json",
    log:
        "results/logs/capture.log",
    benchmark:
        "results/benchmarks/capture.tsv"
    conda:
        "../../envs/specgate.yaml"
    threads: workflow.cores
    params:
        capture=config["capture"],
        device=config["device"],
        code=fingerprint("capture"),
    script:
        "../scripts/capture_hidden.py"
