rule target:
    output:
        directory("results/target"),
    params:
        target=config["target"],
        code=fingerprint("target"),
    log:
        "results/logs/target.log",
    benchmark:
        "results/benchmarks/target.tsv"
    script:
        "../scripts/materialize_target.py"
