# specgate: train an EAGLE-3 drafter for a target model, serve it behind a load gate,
# and find the batch size at which speculation should stop.
#
#   snakemake --cores all results/report.md
#   snakemake --cores all                     # also the archive, results/archive/<run-id>.tar.gz
#
# config/config.yaml is the embedded default (CPU, no network). `--configfile X`
# replaces it entirely: every config file is complete and validated on its own.


if not workflow.overwrite_configfiles:

    configfile: "config/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/target.smk"
include: "workflow/rules/widen.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/regenerate.smk"
include: "workflow/rules/tokenize.smk"
include: "workflow/rules/capture.smk"
include: "workflow/rules/vocab.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/export.smk"
include: "workflow/rules/drafter.smk"
include: "workflow/rules/acceptance.smk"
include: "workflow/rules/bench.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/archive.smk"


report: "workflow/report/workflow.rst"


rule all:
    default_target: True
    input:
        paths.REPORT,
        paths.ARCHIVE.format(run_id=run_id()),
