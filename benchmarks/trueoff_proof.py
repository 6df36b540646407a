#!/usr/bin/env python3
"""The true-off gate inside SGLang on a GPU: greedy identity with no-spec, then a soak.

Three servers on one real target (an HF checkpoint, e.g. the workflow's results/target) with a
one-layer EAGLE-3 drafter of dummy weights, all under --enable-deterministic-inference (unless
--no-deterministic):

  nospec   plain decoding
  always   EAGLE-3 always drafting (the control: does speculation alone change greedy outputs?)
  gated    EAGLE-3 behind the true-off gate (off at batch >= --disable-at), with the host-mirror
           cross-check on every sync-free step and SGLang's strict idle memory check

Identity: the same prompts, greedy, in waves that overlap so the running batch crosses the
threshold both ways (a wave waits for the earlier ones to drain to one request); each server's
output ids per prompt are compared with nospec's.

Soak (gated server only): --requests requests with bursty random arrivals (so the gate switches
often), random output lengths, multi-turn prompts that share prefixes with earlier turns, some
with logprobs, some aborted through /abort_request and some dropped by the client mid-stream.
Reported: failed requests, gate switches and steps, mirror checks, trimmed requests, and the
server's own leak/double-free/use-after-free checks (a hit stops the server), and the prompt
tokens the prefix cache served (SGLang's prefill lines).

Deterministic inference keeps finished requests out of SGLang's radix cache, so a soak that must
hit cached multi-turn prefixes runs with --no-deterministic and --identity-prompts 0:
  python benchmarks/trueoff_proof.py --target results/target --variants gated --no-deterministic \
      --identity-prompts 0 --requests 10000 --burst-period 0.5 --burst-seconds 0.12 --burst-rate 150 --trickle-rate 3

Writes one Markdown page section. Needs a GPU host with SGLang and specgate installed.
  python benchmarks/trueoff_proof.py --target results/target --backend flashinfer --out proof.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

from specgate.sglang.plugin import ENV as GATE_ENV
from specgate.sweep.managed_server import ManagedServer, free_port

TOPICS = ["rivers", "compilers", "bread", "chess", "volcanoes", "jazz", "gardens", "satellites", "tides", "owls",
          "glass", "maps", "bees", "trains", "clouds", "paper", "salt", "bridges", "lanterns", "coral"]  # fmt: skip
ASKS = ["Explain how {t} work in three sentences.", "Write a short poem about {t}.",
        "List four surprising facts about {t}.", "Describe {t} to a child."]  # fmt: skip
LEAK_WORDS = ("memory leak detected", "double free", "use-after-free")
PREFILL_LINE = re.compile(r"Prefill batch.*?#new-token: (\d+), #cached-token: (\d+)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="HF checkpoint directory of the target")
    p.add_argument("--backend", default="flashinfer", choices=("flashinfer", "triton"))
    p.add_argument("--disable-at", type=int, default=4)
    p.add_argument("--identity-prompts", type=int, default=48)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--requests", type=int, default=10000, help="soak requests")
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--mem-fraction", type=float, default=0.5,
                   help="--mem-fraction-static; lower it to share the GPU with a server started later")
    p.add_argument("--variants", default="nospec,always,gated")
    p.add_argument("--no-deterministic", dest="deterministic", action="store_false",
                   help="servers without --enable-deterministic-inference: finished requests enter the radix cache")
    p.add_argument("--burst-period", type=float, default=2.0, help="soak: seconds per burst-and-trickle cycle")
    p.add_argument("--burst-seconds", type=float, default=0.5, help="soak: seconds of each cycle at --burst-rate")
    p.add_argument("--burst-rate", type=float, default=100, help="soak: arrivals per second during a burst")
    p.add_argument("--trickle-rate", type=float, default=5, help="soak: arrivals per second between bursts")
    p.add_argument("--soft-watchdog", type=float,
                   help="SGLang's --soft-watchdog-timeout: a step longer than this many seconds logs the scheduler's "
                        "stacks (py-spy on PATH)")
    p.add_argument("--work-dir")
    p.add_argument("--out", default="trueoff_proof.md")
    return p.parse_args(argv)


def prompts(n: int) -> list[str]:
    return [ASKS[i % len(ASKS)].format(t=TOPICS[i % len(TOPICS)]) + f" (#{i})" for i in range(n)]


def draft_dir(work: Path, target: Path) -> Path:
    cfg = json.loads((target / "config.json").read_text())
    cfg.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, tie_word_embeddings=False,
               target_hidden_size=cfg["hidden_size"], draft_vocab_size=cfg["vocab_size"])  # fmt: skip
    d = work / "draft"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    return d


def command(variant: str, a, port: int, draft: Path, stats: Path) -> tuple[list[str], dict]:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--host", "127.0.0.1", "--port", str(port),
           "--model-path", a.target, "--attention-backend", a.backend, "--grammar-backend", "none",
           "--sampling-backend", "pytorch",  # flashinfer's sampler JIT-compiles on the first sampled request
           "--mem-fraction-static", str(a.mem_fraction),
           "--max-running-requests", str(a.max_running), "--cuda-graph-max-bs-decode", str(a.max_running),
           "--disable-prefill-cuda-graph"]  # fmt: skip
    if a.deterministic:
        cmd.append("--enable-deterministic-inference")
    if a.soft_watchdog:
        cmd += ["--soft-watchdog-timeout", str(a.soft_watchdog)]
    env = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}
    if variant == "nospec":
        return cmd, env
    cmd += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft),
            "--speculative-draft-load-format", "dummy", "--speculative-num-steps", "3",
            "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]  # fmt: skip
    if variant == "gated":
        gate = {"mode": "true-off", "num_steps": 3, "disable_at": a.disable_at, "check_mirror_every": 1}
        env |= {"SGLANG_PLUGINS": "specgate_gate", GATE_ENV: json.dumps(gate), "SPECGATE_STATS_DIR": str(stats)}
    return cmd, env


async def generate(session, url, payload):
    async with session.post(f"{url}/generate", json=payload) as r:
        body = await r.json(content_type=None)
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {str(body)[:200]}")
        return body


async def identity_run(url: str, a) -> dict[int, list[int]]:
    """Waves of 1, 12, 2, 16, 1, 8, 3, 5 ... requests. A wave starts 0.4 s after the one before, and not
    before the earlier requests have drained to one, so every large wave takes the batch above the
    threshold and back below it while requests that ran off steps are still running: each release's
    step speed leaves the same switches, off steps and catch-ups."""
    import aiohttp

    texts = prompts(a.identity_prompts)
    sizes, waves, i = [1, 12, 2, 16, 1, 8, 3, 5], [], 0
    while i < len(texts):
        n = sizes[len(waves) % len(sizes)]
        waves.append(list(range(i, min(i + n, len(texts)))))
        i += n
    params = {"temperature": 0, "max_new_tokens": a.max_new_tokens}
    out = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:

        async def one(k):
            body = await generate(s, url, {"text": texts[k], "sampling_params": params})
            out[k] = body["output_ids"]

        tasks = []
        for wave in waves:
            while sum(not t.done() for t in tasks) > 1:
                await asyncio.sleep(0.05)
            tasks += [asyncio.create_task(one(k)) for k in wave]
            await asyncio.sleep(0.4)
        await asyncio.gather(*tasks)
    return out


async def warm_paths(url: str, disable_at: int) -> float:
    """One request down each path the soak takes, before its clock starts: a sampled one, one with
    logprobs, a greedy and a sampled one together, and a prompt sent twice so the second hits the
    prefix cache (flashinfer compiles its cascade kernels on the first hit and stalls the scheduler
    meanwhile). Then two waves of 6 x disable_at
    requests whose lengths spread out, so the batch crosses the threshold both ways: off steps, a flush
    (48 tokens outrun the default 32-token buffer), a catch-up on resume and speculative steps at the
    batch sizes a draining wave meets. Kernels first used there compile now, not under the soak's load.
    Returns the seconds taken."""
    import aiohttp

    t0, text = time.perf_counter(), prompts(1)[0] * 4
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        for payload in ({"text": text, "sampling_params": {"temperature": 0.8, "max_new_tokens": 8}},
                        {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 8},
                         "return_logprob": True, "top_logprobs_num": 2}):  # fmt: skip
            await generate(s, url, payload)
        # A greedy and a sampled request verified in one speculative batch: greedy rows carry top_k = 1,
        # so SGLang's verify renormalizes with flashinfer's top-k kernel, which compiles on first use.
        await asyncio.gather(*(generate(s, url, {"text": text, "sampling_params": {
            "temperature": temp, "max_new_tokens": 16}}) for temp in (0, 0.8)))  # fmt: skip
        for wave in range(2):
            await asyncio.gather(*(generate(s, url, {"text": t, "sampling_params": {
                "temperature": 0.8 * ((i + wave) % 2), "max_new_tokens": 48 + 4 * i}}) for i, t in enumerate(prompts(6 * disable_at))))
    return round(time.perf_counter() - t0, 1)


async def soak(url: str, a, rng: random.Random) -> dict:
    """Bursty arrivals over multi-turn chats; aborts, disconnects and logprob requests mixed in."""
    import aiohttp

    chats = [[text] for text in prompts(200)]
    counts = {"ok": 0, "failed": 0, "aborted": 0, "dropped": 0, "logprob": 0, "errors": []}
    sem = asyncio.Semaphore(4 * a.max_running)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:

        async def one(k):
            async with sem:
                chat = chats[rng.randrange(len(chats))]
                rid = f"soak-{k}"
                params = {"temperature": 0 if k % 2 else 0.8, "max_new_tokens": rng.randint(1, 64)}
                payload = {"text": " ".join(chat), "rid": rid, "sampling_params": params}
                if k % 20 == 0:
                    payload |= {"return_logprob": True, "top_logprobs_num": 2}
                    counts["logprob"] += 1
                fate = rng.random()
                try:
                    if fate < 0.03:  # the client goes away mid-request
                        counts["dropped"] += 1
                        await asyncio.wait_for(generate(s, url, payload), timeout=rng.uniform(0.01, 0.3))
                    elif fate < 0.06:  # the server is asked to abort it
                        task = asyncio.create_task(generate(s, url, payload))
                        await asyncio.sleep(rng.uniform(0.01, 0.3))
                        async with s.post(f"{url}/abort_request", json={"rid": rid}) as r:
                            await r.read()
                        counts["aborted"] += 1
                        await task
                    else:
                        body = await generate(s, url, payload)
                        if payload.get("return_logprob") and len(body["meta_info"]["output_token_logprobs"]) != len(
                            body["output_ids"]
                        ):
                            raise RuntimeError("logprob rows do not match the output tokens")
                        chat.append(body["text"][:200] + f" Next question {k}?")
                        del chat[:-4]  # a chat keeps its last turns: later prompts share their prefix
                    counts["ok"] += 1
                except asyncio.TimeoutError:
                    pass
                except Exception as e:  # noqa: BLE001 - every failure is counted and shown
                    if fate < 0.06:
                        return  # an aborted request may answer with an error: that is the abort
                    counts["failed"] += 1
                    counts["errors"].append(f"{type(e).__name__}: {e}"[:200])

        # arrivals: a Poisson process whose rate is --burst-rate for the first --burst-seconds of every
        # --burst-period and --trickle-rate after, drawn by thinning candidates at the burst rate (a long
        # trickle gap drawn whole would skip over the next burst)
        async def progress():  # a soak stopped early still leaves its counts in the log
            while True:
                await asyncio.sleep(30)
                shown = {k: v for k, v in counts.items() if k != "errors"}
                print(f"  [{time.strftime('%H:%M:%S')}] {len(tasks)} sent: {json.dumps(shown)}", flush=True)

        tasks, t0 = [], time.perf_counter()
        reporter = asyncio.create_task(progress())
        while len(tasks) < a.requests:
            await asyncio.sleep(rng.expovariate(a.burst_rate))
            burst = (time.perf_counter() - t0) % a.burst_period < a.burst_seconds
            if burst or rng.random() < a.trickle_rate / a.burst_rate:
                tasks.append(asyncio.create_task(one(len(tasks))))
        await asyncio.gather(*tasks)
        reporter.cancel()
        counts["seconds"] = round(time.perf_counter() - t0, 1)
        async with s.get(f"{url}/server_info") as r:
            info = await r.json()
    counts["gate"] = next((st["specgate_gate"] for st in info.get("internal_states", []) if "specgate_gate" in st), None)
    counts["errors"] = counts["errors"][:5]
    return counts


def main(argv=None) -> int:
    a = parse_args(argv)  # first: --help needs no SGLang
    import sglang
    import torch

    work = Path(a.work_dir or tempfile.mkdtemp(prefix="trueoff_proof-"))
    work.mkdir(parents=True, exist_ok=True)
    draft = draft_dir(work, Path(a.target))
    outputs, soak_result, logs = {}, None, {}
    for variant in a.variants.split(","):
        port = free_port()
        cmd, extra = command(variant, a, port, draft, work / "stats")
        env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_PLUGINS", GATE_ENV)} | extra
        log = logs[variant] = work / f"server_{variant}.log"
        print(f"[{time.strftime('%H:%M:%S')}] {variant}: {shlex.join(cmd)}", flush=True)
        with ManagedServer(cmd, port, log, ready_timeout=900, env=env) as server:
            if a.identity_prompts:
                outputs[variant] = asyncio.run(identity_run(server.url, a))
                print(f"  identity run done: {len(outputs[variant])} outputs", flush=True)
            if variant == "gated" and a.requests:
                print(f"  warm-up of the soak's paths: {asyncio.run(warm_paths(server.url, a.disable_at))} s", flush=True)
                soak_result = asyncio.run(soak(server.url, a, random.Random(7)))
                print(f"  soak: {json.dumps(soak_result)}", flush=True)
                time.sleep(5)  # idle: SGLang's strict memory check runs now
                if server.proc.poll() is not None:
                    soak_result["server_died"] = True
        text = log.read_text(errors="replace")
        if variant == "gated" and soak_result is not None:  # how much of the prompts the prefix cache served
            new, cached = (sum(int(m[i]) for m in PREFILL_LINE.findall(text)) for i in (0, 1))
            soak_result["prefill_tokens"] = {"computed": new, "from_cache": cached}
        logs[variant] = [ln.strip()[:300] for ln in text.splitlines() if any(w in ln for w in LEAK_WORDS)][:5]

    lines = [f"`{shlex.join(['python', 'benchmarks/trueoff_proof.py', *sys.argv[1:]])}`", "",
             f"{torch.cuda.get_device_name(0)}; SGLang {sglang.__version__}, torch {torch.__version__}; "
             f"{a.backend} attention; {'--enable-deterministic-inference' if a.deterministic else 'radix cache on'};"
             f" gate off at batch >= {a.disable_at}.", ""]  # fmt: skip
    base = outputs.get("nospec")
    if base:
        lines += ["| server | prompts | identical to nospec | first differing prompt |", "|---|---|---|---|"]
        for v, out in outputs.items():
            same = [k for k in base if out.get(k) == base[k]]
            diff = next((k for k in sorted(base) if out.get(k) != base[k]), None)
            first = "-" if diff is None else diff
            lines.append(f"| {v} | {len(base)} | {len(same)} ({len(same) / len(base):.1%}) | {first} |")
    if soak_result is not None:
        lines += ["", "Soak (gated server):", "", "```json", json.dumps(soak_result, indent=1), "```"]
    lines += ["", "Server log lines naming a leak, a double free or a use-after-free: "
              + json.dumps({v: found for v, found in logs.items()})]  # fmt: skip
    Path(a.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
