rule report:
    input:
        unpack(report_inputs),
    output:
        report=paths.REPORT,
        provenance=paths.PROVENANCE,
        levels=paths.LEVELS,
        recommendation=paths.RECOMMENDATION,
        plots=[
            report(
                paths.PLOT.format(name=name),
                caption=f"../report/{name}.rst",
                category="Results",
            )
            for name in plot_names()
        ],
    log:
        paths.log("report"),
    conda:
        "../../envs/specgate.yaml"
    params:
        repo=workflow.basedir,
        code=fingerprint("report.report"),
    script:
        "../scripts/report.py"
