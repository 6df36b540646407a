"""SGLang 0.5.15 + specgate's load-gate plugin on one GPU (issue 6, item 2): a thin driver.

Servers are built by specgate.launcher.sglang_command and run by
specgate.lifecycle.ManagedServer, exactly as the sweep does; prompts are the eval set's
first user turns through specgate.chat.prompt_ids (as specgate.acceptance builds them).
For each variant (default: always, gate_4):
  1. start the server, time it to /health_generate;
  2. warm-up: 2 requests at concurrency 1;
  3. (always only) acceptance pass: the first 32 prompts of each eval source, 96 new
     tokens, stop at EOS, concurrency 16, as specgate.acceptance measured tau offline;
     then /server_info avg_spec_accept_length;
  4. closed loop at each concurrency (greedy, ignore_eos, --max-new tokens), output tok/s,
     per-request tokens per verify step; /server_info after each level;
  5. the server log's plugin / gate / decode-batch lines.

usage: python gpu/sglang_smoke.py --target T --draft D --eval eval.jsonl --acceptance acceptance.csv --out DIR
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import re
import sys
import time
import urllib.request
from importlib.metadata import entry_points

import aiohttp

from specgate.chat import prompt_ids
from specgate.files import read_jsonl
from specgate.launcher import ServeSettings, sglang_command, variants
from specgate.lifecycle import ManagedServer, free_port

EXTRA = ("--attention-backend triton --sampling-backend pytorch --grammar-backend none --mem-fraction-static 0.5 "
         "--cuda-graph-max-bs 64 --disable-prefill-cuda-graph")  # fmt: skip


def sglang_port() -> int:
    """lifecycle.free_port(), retried until port + 10000 <= 65535: SGLang 0.5.15 derives its gRPC port as
    --port + 10000 and refuses to start above 65535 (seen on the H200 with port 57907)."""
    for _ in range(100):
        port = free_port()
        if port <= 55535:
            return port
    raise OSError("no free port <= 55535")


def log(*a):
    print(f"[smoke {time.strftime('%H:%M:%S')}]", *a, flush=True)


def load_prompts(target: str, eval_jsonl: str, max_prompt_tokens: int = 1024) -> list[tuple[str, list[int]]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    out = []
    for rec in read_jsonl(eval_jsonl):
        msgs = rec["messages"][:1] if rec["messages"][0]["role"] != "system" else rec["messages"][:2]
        ids = prompt_ids(tok, msgs)
        if len(ids) <= max_prompt_tokens:
            out.append((rec["source"], ids))
    return out


def interleave(prompts):
    """Alternate sources so every level sees both."""
    by = {}
    for s, ids in prompts:
        by.setdefault(s, []).append((s, ids))
    out, i = [], 0
    while any(i < len(v) for v in by.values()):
        out += [v[i] for v in by.values() if i < len(v)]
        i += 1
    return out


async def closed_loop(url, prompts, conc, n, max_new, ignore_eos=True):
    recs, nxt = [], [0]
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as sess:
        t0 = time.perf_counter()

        async def worker():
            while nxt[0] < n:
                i = nxt[0]
                nxt[0] += 1
                src, ids = prompts[i % len(prompts)]
                ts = time.perf_counter()
                params = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": ignore_eos}
                body = {"input_ids": ids, "sampling_params": params}
                async with sess.post(url + "/generate", json=body) as r:
                    j = await r.json()
                m = j["meta_info"]
                recs.append({"source": src, "t0": ts - t0, "t1": time.perf_counter() - t0,
                             "completion_tokens": m["completion_tokens"], "verify_ct": m.get("spec_verify_ct") or 0,
                             "spec_accept_length": m.get("spec_accept_length")})  # fmt: skip

        await asyncio.gather(*[worker() for _ in range(conc)])
    wall = max(r["t1"] for r in recs)
    toks = sum(r["completion_tokens"] for r in recs)
    return {"conc": conc, "requests": len(recs), "max_new": max_new, "ignore_eos": ignore_eos, "wall_s": round(wall, 3),
            "out_tokens": toks, "out_tok_per_s": round(toks / wall, 1),
            "mean_latency_s": round(sum(r["t1"] - r["t0"] for r in recs) / len(recs), 3), **tau_by_source(recs)}  # fmt: skip


def tau_by_source(recs) -> dict:
    """Tokens per verify step, per source: completion/verify (SGLang's definition, counts the prefill token)
    and (completion-1)/verify (tokens made by verify steps only, specgate.acceptance's definition)."""
    out = {}
    for src in sorted({r["source"] for r in recs}) + ["all"]:
        rs = [r for r in recs if src in ("all", r["source"])]
        ver = sum(r["verify_ct"] for r in rs)
        if ver:
            out[f"tau_{src}"] = round(sum(r["completion_tokens"] for r in rs) / ver, 4)
            out[f"tau_verify_only_{src}"] = round(sum(r["completion_tokens"] - 1 for r in rs) / ver, 4)
            out[f"verify_ct_{src}"] = ver
    return out


def server_info(url) -> dict:
    with urllib.request.urlopen(url + "/server_info", timeout=30) as r:
        si = json.loads(r.read())
    ist = si.get("internal_states") or [{}]
    keep = ("version", "speculative_algorithm", "speculative_adaptive", "speculative_num_steps",
            "speculative_num_draft_tokens", "speculative_eagle_topk", "attention_backend", "sampling_backend",
            "max_running_requests", "cuda_graph_max_bs")  # fmt: skip
    out = {k: si.get(k) for k in keep}
    out["avg_spec_accept_length"] = [x.get("avg_spec_accept_length") for x in ist]
    return out


PATTERNS = (
    r"specgate|[Pp]lugin|AdaptiveSpec|adaptive|Switch|Traceback|Error|error|Load weight end|KV Cache is alloc"
    r"|Capture cuda graph end"
)


def log_lines(path, start=0):
    with open(path, errors="replace") as f:
        f.seek(start)
        text = f.read()
    interesting = [ln[:400] for ln in text.splitlines() if re.search(PATTERNS, ln) and "Ignore import error" not in ln]
    decode = []
    for ln in text.splitlines():
        m = re.search(r"Decode batch.*?#running-req: (\d+).*?gen throughput \(token/s\): ([\d.]+)", ln)
        if m:
            a = re.search(r"accept len: ([\d.]+)", ln)
            decode.append((int(m.group(1)), float(m.group(2)), float(a.group(1)) if a else None))
    return interesting, decode


def offline_tau(acceptance_csv, num_steps) -> dict:
    with open(acceptance_csv) as f:
        return {r["source"]: float(r["tau"]) for r in csv.DictReader(f) if int(r["num_steps"]) == num_steps}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--eval", required=True)
    p.add_argument("--acceptance", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--variants", default="always,gate_4")
    p.add_argument("--conc", default="1,16")
    p.add_argument("--requests", default="1:16,16:64", help="requests per concurrency level")
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--num-steps", type=int, default=3)
    p.add_argument("--extra", default=EXTRA)
    p.add_argument("--ready-timeout", type=float, default=420)
    p.add_argument("--accept-per-source", type=int, default=32, help="prompts per eval source in the acceptance pass")
    p.add_argument("--accept-max-new", type=int, default=96, help="as config acceptance.max_new_tokens")
    a = p.parse_args()
    eps = [(e.name, e.value, e.dist.name if e.dist else None) for e in entry_points(group="sglang.srt.plugins")]
    log("sglang.srt.plugins entry points seen by this interpreter:", eps)
    prompts = interleave(load_prompts(a.target, a.eval))
    per_source = {}
    for s, ids in prompts:
        per_source.setdefault(s, []).append((s, ids))
    accept_prompts = interleave([x for v in per_source.values() for x in v[: a.accept_per_source]])
    n_req = dict(tuple(map(int, kv.split(":"))) for kv in a.requests.split(","))
    wanted = a.variants.split(",")
    settings = ServeSettings(a.target, a.draft, num_steps=a.num_steps, max_running=64, extra_args=a.extra.split())
    res = {"command": "python gpu/sglang_smoke.py " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
           "entry_points": eps, "prompts": len(prompts), "offline_tau": offline_tau(a.acceptance, a.num_steps),
           "variants": {}}  # fmt: skip
    out_json = f"{a.out}/sglang_smoke.json"
    thresholds = sorted({int(w.split("_")[1]) for w in wanted if w.startswith("gate_")})
    for v in [v for v in variants(thresholds) if v.name in wanted]:
        port = sglang_port()
        cmd, env = sglang_command(settings, v, port, f"{a.out}/work")
        logp = f"{a.out}/srv_{v.name}.log"
        r = {"cmd": cmd, "SPECGATE_GATE": env.get("SPECGATE_GATE")}
        res["variants"][v.name] = r
        log(v.name, "launch:", " ".join(cmd), "SPECGATE_GATE=", env.get("SPECGATE_GATE"))
        t0 = time.time()
        try:
            with ManagedServer(cmd, port, logp, env=env, ready_timeout=a.ready_timeout) as srv:
                r["startup_s"] = round(time.time() - t0, 1)
                log(v.name, "ready in", r["startup_s"], "s")
                asyncio.run(closed_loop(srv.url, prompts, 1, 2, 16))
                if v.name == "always":
                    r["accept_pass"] = asyncio.run(
                        closed_loop(srv.url, accept_prompts, 16, len(accept_prompts), a.accept_max_new, ignore_eos=False)
                    )
                    r["server_info_after_accept_pass"] = server_info(srv.url)
                    log(v.name, "accept pass", json.dumps(r["accept_pass"]), json.dumps(r["server_info_after_accept_pass"]))
                r["levels"] = []
                for c in map(int, a.conc.split(",")):
                    off = srv.log_path.stat().st_size
                    lv = asyncio.run(closed_loop(srv.url, prompts, c, n_req.get(c, 4 * c), a.max_new))
                    time.sleep(0.5)
                    lv["server_info"] = server_info(srv.url)
                    lines, decode = log_lines(logp, off)
                    lv["gate_lines"] = [ln for ln in lines if "specgate" in ln][:40]
                    lv["decode_lines"] = decode[:60]
                    r["levels"].append(lv)
                    log(v.name, "level", json.dumps({k: x for k, x in lv.items() if k not in ("gate_lines", "decode_lines")}))
                    for ln in lv["gate_lines"][:8]:
                        log("   ", ln)
                    json.dump(res, open(out_json, "w"), indent=1)
        except Exception as e:
            import traceback

            r["error"] = traceback.format_exc()[-4000:]
            log(v.name, "FAILED", type(e).__name__, str(e)[-3000:])
        r["log_lines"] = log_lines(logp)[0][-80:]
        json.dump(res, open(out_json, "w"), indent=1)
    log("summary")
    for name, r in res["variants"].items():
        for lv in r.get("levels", []):
            log(f"  {name} c={lv['conc']}: {lv['out_tok_per_s']} tok/s, tau(all)={lv.get('tau_all')}, "
                f"server avg_spec_accept_length={lv['server_info']['avg_spec_accept_length']}")  # fmt: skip
        if "accept_pass" in r:
            taus = {k: x for k, x in r["accept_pass"].items() if k.startswith("tau")}
            server = r["server_info_after_accept_pass"]["avg_spec_accept_length"]
            log(f"  {name} accept pass: {json.dumps(taus)}; server {server}; offline {res['offline_tau']}")
    return 0 if all("error" not in r for r in res["variants"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
