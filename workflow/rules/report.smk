rule report:
    input:
        unpack(report_inputs),
    output:
        report="results/report.md",
    log:
        "results/logs/report.log",
    conda:
        "../../envs/specgate.yaml"
    params:
        repo=workflow.basedir,
        code=fingerprint("report"),
    script:
        "../scripts/write_report.py"
