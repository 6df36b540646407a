# Everything needed to read, check and rebuild this experiment's report, in one file.
# Rebuild elsewhere: specgate rebuild-report results/archive/<run-id>.tar.gz DEST
rule archive:
    input:
        unpack(report_inputs),
        report=paths.REPORT,
        provenance=paths.PROVENANCE,
        plots=[paths.PLOT.format(name=name) for name in plot_names()],
        levels=paths.LEVELS,
        recommendation=paths.RECOMMENDATION,
    output:
        paths.ARCHIVE.format(run_id=run_id()),
    log:
        paths.log("archive"),
    conda:
        "../../envs/specgate.yaml"
    params:
        run_id=run_id(),
        include_drafter=config["archive"]["include_drafter"],
        configfiles=workflow.overwrite_configfiles or ["config/config.yaml"],
        snakefile=workflow.main_snakefile,
        repo=workflow.basedir,
        code=fingerprint("report.archive"),
    script:
        "../scripts/archive.py"
