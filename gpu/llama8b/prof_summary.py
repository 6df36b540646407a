"""Reduce torch-profiler traces written by SGLang's /start_profile to a per-step breakdown.

usage: prof_summary.py TRACE_DIR OUT.json
Per trace: the span of GPU activity, the GPU-busy time (union of kernel intervals), the number of
graph launches (one per replayed CUDA graph), and kernel time by category and by kernel name. A gap
between busy time and span is time the GPU waited on the host (launch, scheduling, syncs).
"""

import gzip
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

CATEGORIES = [  # first match wins
    ("attention", re.compile(r"attn|attention|_fwd_kernel|flashinfer|BatchDecode|BatchPrefill|Prefill|Decode|mla|fmha", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|nvjet|xmma|cublas|matmul|splitK|sm90_|sm80_|wgmma", re.I)),
    ("memcpy/memset", re.compile(r"memcpy|memset", re.I)),
    ("sampling/topk/softmax", re.compile(r"topk|softmax|argmax|sampl|sort|cumsum|radix", re.I)),
    (
        "norm/act/rope/elementwise",
        re.compile(
            r"norm|silu|gelu|act_and_mul|rotary|rope|elementwise|vectorized|unrolled|reduce|copy|index|cat|fill|triton", re.I
        ),
    ),
]


def summarise(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not kernels:
        return {"trace": path.name, "kernels": 0}
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels)
    busy, cur_s, cur_e = 0.0, *spans[0]
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = spans[-1][1] - spans[0][0]
    by_cat, by_name = defaultdict(float), defaultdict(float)
    for e in kernels:
        name = e["name"]
        cat = next((c for c, rx in CATEGORIES if rx.search(name)), "other")
        by_cat[cat] += e["dur"]
        by_name[name[:120]] += e["dur"]
    graph_launches = sum(1 for e in events if e.get("ph") == "X" and "cudaGraphLaunch" in e.get("name", ""))
    syncs = sum(1 for e in events if e.get("ph") == "X" and re.search(r"Synchronize", e.get("name", "")))
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:20]
    ms = lambda us: round(us / 1000, 3)  # noqa: E731
    return {
        "trace": path.name,
        "kernels": len(kernels),
        "span_ms": ms(span),
        "gpu_busy_ms": ms(busy),
        "gpu_busy_fraction": round(busy / span, 3),
        "graph_launches": graph_launches,
        "host_syncs": syncs,
        "by_category_ms": {k: ms(v) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
        "top_kernels_ms": {k: ms(v) for k, v in top},
    }


if __name__ == "__main__":
    traces = sorted(p for p in Path(sys.argv[1]).rglob("*") if p.name.endswith((".trace.json.gz", ".trace.json")))
    out = [summarise(p) for p in traces]
    Path(sys.argv[2]).write_text(json.dumps(out, indent=1))
    for o in out:
        print(
            json.dumps(
                {
                    k: o.get(k)
                    for k in (
                        "trace",
                        "span_ms",
                        "gpu_busy_ms",
                        "gpu_busy_fraction",
                        "graph_launches",
                        "host_syncs",
                        "by_category_ms",
                    )
                }
            )
        )
