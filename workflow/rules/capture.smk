# Shards live beside the index in results/capture/shards/. Only the index is the
# declared output, so Snakemake does not delete finished shards of a killed run and
# a rerun resumes at the first missing shard. capture.mode online leaves this rule out of the plan:
# training computes the states itself (train.smk).
rule capture:
    input:
        tokens=paths.TOKENS,
        target=paths.TARGET,
    output:
        index=paths.CAPTURE_INDEX,
    log:
        paths.log("capture"),
    benchmark:
        paths.stage_times("capture")
    conda:
        "../../envs/specgate.yaml"
    threads: all_cores
    params:
        capture=offline_capture_settings(),
        device=config["device"],
        code=fingerprint("pipeline.capture"),
    script:
        "../scripts/capture.py"
