# Everything needed to read, check and rebuild this experiment's report, in one file.
# Rebuild elsewhere: specgate rebuild-report results/archive/<run-id>.tar.gz DEST
rule archive:
    input:
        unpack(report_inputs),
        report="results/report.md",
        provenance="results/report/provenance.json",
        plots=expand("results/report/{name}.png", name=PLOTS),
        records=expand("results/bench/{variant}.jsonl", variant=sweep_variants()),
    output:
        f"results/archive/{run_id()}.tar.gz",
    log:
        "results/logs/archive.log",
    conda:
        "../../envs/specgate.yaml"
    params:
        run_id=run_id(),
        include_drafter=config["archive"]["include_drafter"],
        configfiles=workflow.overwrite_configfiles or ["config/config.yaml"],
        snakefile=workflow.main_snakefile,
        repo=workflow.basedir,
        code=fingerprint("archive"),
    script:
        "../scripts/write_archive.py"
