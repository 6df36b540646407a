rule report:
    input:
        unpack(report_inputs),
    output:
        report="results/report.md",
    params:
        repo=workflow.basedir,
        code=fingerprint("report"),
    log:
        "results/logs/report.log",
    script:
        "../scripts/write_report.py"
