# The target writes the replies the drafter learns from (data.regenerate.enabled), with
# SGLang's offline engine or specgate's reference decoder (data.regenerate.engine).
# Parts live beside the output in results/data/train_regen.parts/, not declared, so a
# killed run resumes at the first missing part.
rule regenerate:
    input:
        conversations=paths.DATA_TRAIN,
        target=paths.TARGET,
    output:
        conversations=paths.REGEN_TRAIN,
        summary=paths.REGEN_SUMMARY,
    log:
        paths.log("regenerate"),
    benchmark:
        paths.stage_times("regenerate")
    conda:
        "../../envs/specgate.yaml"
    threads: all_cores
    params:
        regenerate={
            k: v for k, v in config["data"]["regenerate"].items() if k != "enabled"
        },
        max_prompt_tokens=config["tokenize"]["max_length"],  # later turns would be cut by tokenize
        seed=config["seed"],
        device=config["device"],
        code=fingerprint("pipeline.regenerate"),
    script:
        "../scripts/regenerate.py"
