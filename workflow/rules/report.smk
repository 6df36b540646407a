rule report:
    input:
        unpack(report_inputs),
    output:
        report="results/report.md",
        provenance="results/report/provenance.json",
        plots=[
            report(
                f"results/report/{name}.png",
                caption=f"../report/{name}.rst",
                category="Results",
            )
            for name in PLOTS
        ],
    log:
        "results/logs/report.log",
    conda:
        "../../envs/specgate.yaml"
    params:
        repo=workflow.basedir,
        code=fingerprint("report"),
    script:
        "../scripts/write_report.py"
