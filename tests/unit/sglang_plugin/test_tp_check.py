"""specgate check-tp-log: the evidence that tensor-parallel ranks took the same gate decisions."""

from pathlib import Path

from specgate.cli import main as cli

ARMED = "specgate true-off armed: plain decode graph bs=[1, 2], 0.12 GB in {t} s; gate {{'gate_on': True}} (pid {pid})"
SWITCH = 'specgate gate {state} at batch {bs}: {{"steps_on": {on}, "steps_off": {off}, "switches": {n}}}'


def write_log(path: Path, rank_lines: dict[int, list[str]]) -> Path:
    lines = []
    for i in range(max(len(v) for v in rank_lines.values())):
        for rank, events in rank_lines.items():
            if i < len(events):  # a progress bar sharing the line, as in real SGLang logs
                lines.append(f"Capturing batches:  50%|#####\r[2026-11-29 22:25:{10 + i:02d} TP{rank}] {events[i]}")
    path.write_text("\n".join(["[2026-11-29 22:25:00] server_args=...", *lines]) + "\n")
    return path


def test_ranks_with_the_same_decisions_pass_and_a_divergent_rank_fails(tmp_path, capsys):
    same = [SWITCH.format(state="off", bs=5, on=9, off=1, n=1), SWITCH.format(state="on", bs=1, on=10, off=128, n=2)]
    good = write_log(tmp_path / "good.log", {0: [ARMED.format(t=3.0, pid=11), *same], 1: [ARMED.format(t=3.1, pid=12), *same]})
    assert cli(["check-tp-log", str(good)]) == 0
    assert "identical on every rank" in capsys.readouterr().out

    # rank 1 stayed on one step longer: the counters differ, which would hang NCCL in a real server
    other = [same[0], SWITCH.format(state="on", bs=1, on=11, off=127, n=2)]
    bad = write_log(tmp_path / "bad.log", {0: [ARMED.format(t=3.0, pid=11), *same], 1: [ARMED.format(t=3.0, pid=12), *other]})
    assert cli(["check-tp-log", str(bad)]) == 1
    assert "DIFFER" in capsys.readouterr().out

    # a single rank proves nothing about agreement
    alone = write_log(tmp_path / "alone.log", {0: [ARMED.format(t=3.0, pid=11), *same]})
    assert cli(["check-tp-log", str(alone)]) == 1
