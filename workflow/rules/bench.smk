# The threshold sweep, per round: one job for every variant ("all", bench.design switched: one
# speculative server whose gate is switched between blocks, beside one no-spec server), or one job
# per variant (paired: each with a no-spec server of its own). Round r of every job runs before
# round r+1 of any (round_priority). Jobs never overlap: on CPU each takes every core, and
# bench_slot=1 (profiles/default) keeps GPU runs apart too.
rule bench:
    input:
        unpack(bench_inputs),
    output:
        records=paths.BENCH_RECORDS,
        summary=paths.BENCH_SUMMARY,
    log:
        main=paths.log("bench/{variant}.round{round}"),
        server=f"{paths.LOGS}/bench/{{variant}}.round{{round}}.server.log",
    benchmark:
        paths.stage_times("bench_{variant}.round{round}")
    wildcard_constraints:
        variant="all|nospec|always|auto|sglang_adaptive|gate_[0-9]+(_[0-9]+)?|steps0_[0-9]+",
        round="[0-9]+",
    priority: round_priority
    conda:
        "../../envs/specgate.yaml"
    threads: all_cores
    resources:
        bench_slot=1,
        gpu=config["serve"]["tp"] if config["serve"]["engine"] == "sglang" else 0,
    params:
        variant=variant_params,
        bench=level_params(),
        engine=config["serve"]["engine"],
        serve=config["serve"],
        device=config["device"],
        seed=config["seed"],
        round=lambda wildcards: int(wildcards.round),
        work_dir=paths.BENCH_WORK,
        code=fingerprint("sweep.bench", "engine.server"),  # and the server it launches
    script:
        "../scripts/bench.py"
