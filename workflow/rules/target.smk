rule target:
    output:
        directory("results/target"),
    log:
        "results/logs/target.log",
    benchmark:
        "results/benchmarks/target.tsv"
    conda:
        "../../envs/specgate.yaml"
    threads: workflow.cores
    params:
        target=config["target"],
        code=fingerprint("target"),
    script:
        "../scripts/materialize_target.py"
