rule vocab:
    input:
        tokens="results/tokens/train.safetensors",
        target="results/target",
    output:
        vocab="results/vocab/vocab.safetensors",
        summary="results/vocab/summary.json",
    log:
        "results/logs/vocab.log",
    benchmark:
        "results/benchmarks/vocab.tsv"
    conda:
        "../../envs/specgate.yaml"
    params:
        draft_vocab_size=config["vocab"]["draft_vocab_size"],
        code=fingerprint("vocab"),
    script:
        "../scripts/build_vocab.py"
