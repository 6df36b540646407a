"""Did every tensor-parallel rank of an SGLang server make the same gate decisions?

    specgate check-tp-log results/logs/bench/gate_4.server.log [...]

SGLang tags each scheduler's lines `[... TPn]`. The plugin logs every gate switch with its
counters (steps on/off, switches, plain steps). A disagreement between ranks would hang NCCL,
so each rank's sequence of switch lines, with the timestamp and rank tag removed, must be the
same; so must each rank's "true-off armed" line, but for its pid and arming time. A log with a
single rank proves nothing about agreement and fails.
"""

from __future__ import annotations

import re
from collections import defaultdict

LINE = re.compile(r"\[\d{4}-\d\d-\d\d [\d:]+ TP(\d+)\] (specgate (?:gate (?:on|off) at batch|true-off armed).*)$")

PER_PROCESS = re.compile(r" in [\d.]+ s;| \(pid \d+\)")


def rank_events(path: str) -> dict[int, list[str]]:
    events: dict[int, list[str]] = defaultdict(list)
    with open(path, errors="replace") as f:
        for raw in f:
            for part in raw.split("\r"):  # progress bars share lines with log records
                m = LINE.search(part.rstrip("\n"))
                if m:  # the rank's own pid and arming time are the only fields allowed to differ
                    events[int(m.group(1))].append(PER_PROCESS.sub("", m.group(2)))
    return dict(events)


def check_logs(paths: list[str]) -> int:
    """Print one verdict line per log; 0 if every log shows identical decisions on two or more ranks."""
    ok = True
    for path in paths:
        events = rank_events(path)
        ranks = sorted(events)
        counts = {r: len(events[r]) for r in ranks}
        same = len(ranks) > 1 and all(events[r] == events[ranks[0]] for r in ranks)
        gate_lines = sum(e.startswith("specgate gate") for e in events.get(ranks[0], [])) if ranks else 0
        armed = sum(e.startswith("specgate true-off armed") for e in events.get(ranks[0], [])) if ranks else 0
        print(f"{path}: ranks {ranks}, lines per rank {counts}, gate lines {gate_lines}, armed {armed}: "
              f"{'identical on every rank' if same else 'DIFFER'}")  # fmt: skip
        if not same:
            ok = False
            for r in ranks:
                print(f"  TP{r}: {events[r]}")
    return 0 if ok else 1

