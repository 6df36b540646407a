"""Real Snakemake runs on a tiny config: full chain, no-op rerun, and rerun granularity."""

import contextlib
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, with_local_target_dir, write_conversations

pytestmark = pytest.mark.slow


def snakemake(workdir, *args, env=None):
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(workdir),
         "--configfile", str(workdir / "config.yaml"), "--cores", "2", *args],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def planned_counts(output: str) -> dict[str, int]:
    """Rule name -> job count, from the 'Job stats' table of a dry run."""
    if "Nothing to be done" in output:
        return {}
    table = output.split("Job stats:")[1].split("total")[0]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)\s*$", table, re.M)}


def planned_jobs(output: str) -> set[str]:
    """Rule names in the 'Job stats' table of a dry run."""
    return set(planned_counts(output)) - {"job"}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny_llama_dir):
    work = tmp_path_factory.mktemp("workflow")
    chats = write_conversations(work / "chats.jsonl", 60)
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    config["run_name"] = "tiny"
    config["device"] = "cpu"
    config["target"] = {"source": "hf_dir", "path": str(tiny_llama_dir), "dtype": "float32",
                        # served widened: every stage of target.widen runs, and the sweep serves the widened pair
                        "widen": {"hidden_size": 96, "num_layers": 9, "intermediate_size": 160, "num_heads": 8,
                                  "num_kv_heads": 4}}  # fmt: skip
    config["data"]["sources"] = [
        {"name": "chats", "kind": "jsonl", "path": str(chats), "train": 40, "eval": 10},
        {"name": "humaneval", "kind": "humaneval", "train": 8, "eval": 4},
    ]
    config["data"]["regenerate"] |= {"enabled": True, "max_new_tokens": 16, "chunk_size": 16}  # every stage runs
    config["tokenize"]["max_length"] = 128
    config["capture"] |= {"batch_tokens": 512, "shard_tokens": 2048}
    config["vocab"]["draft_vocab_size"] = 512
    config["train"] |= {"ttt_length": 2, "epochs": 1, "batch_tokens": 1024, "checkpoint_every": 5}
    config["acceptance"] |= {"num_steps": [2], "max_new_tokens": 8, "prompts_per_source": 2, "batch_size": 2}
    config["serve"] = {"num_steps": 2, "max_running": 4, "max_len": 512, "ready_timeout": 120}
    config["bench"] = {"thresholds": [2], "auto": True, "concurrency": [1, 2], "rounds": 2, "blocks": 2,
                       "warmup_s": 0.2, "window_s": 0.8, "request_rates": [12.5], "rate_window_s": 0.8, "prompts": 6,
                       "max_tokens": 8}  # fmt: skip
    (work / "config.yaml").write_text(yaml.safe_dump(config))
    # A private copy of the package, first on PYTHONPATH, so the test can edit its code.
    shutil.copytree(REPO / "src/specgate", work / "pkg/specgate")
    env = dict(os.environ, PYTHONPATH=f"{work / 'pkg'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    snakemake(work, "results/report.md", env=env)
    return work, env


def test_full_chain_builds_every_artifact(workdir):
    work, _ = workdir
    for path in ["results/target/manifest.json", "results/data/summary.json", "results/tokens/train.safetensors",
                 "results/capture/index.json", "results/vocab/vocab.safetensors", "results/train/metrics.csv",
                 "results/drafter/model.safetensors", "results/acceptance.csv", "results/report.md",
                 "results/target_widened/manifest.json", "results/drafter_widened/model.safetensors",
                 "results/acceptance_unwidened.csv"]:  # fmt: skip
        assert (work / path).exists(), path
    report = (work / "results/report.md").read_text()
    for section in ["## Hidden-state capture", "## Draft vocabulary", "## Drafter training", "## Acceptance length",
                    "## Threshold sweep", "## Envelope efficiency", "## Recommended threshold", "## Cost model"]:  # fmt: skip
        assert section in report
    # the report states the pick that recommendation.json records (one threshold is swept here, so which gate it
    # picks is tested on constructed blocks in tests/unit/report)
    rec = json.loads((work / "results/report/recommendation.json").read_text())
    assert "## Recommended threshold\n\n**" in report and f"({rec['pick']})" in report.split("## Recommended threshold")[1]
    assert "### The auto gate" in report and "threshold settled" in report  # the auto variant ran in the sweep
    assert "Served widened (`target.widen`)" in report and "τ before widening" in report
    assert "median over blocks [90% bootstrap interval]" in report and "Design **switched**" in report
    assert "### Ratio to the no-spec block beside it" in report and "## Open loop: the operator's traffic" in report
    # gate_2 turns off at c = 2 and after the prime burst, and speculates again: its first steps after that are counted
    assert "### Acceptance after the gate turns back on" in report and "| gate_2 |" in report.split("turns back on")[1]
    with open(work / "results/acceptance.csv") as f:
        measured = list(csv.DictReader(f))
    table = report.split("## Acceptance length")[1].split("\n\n")[1]
    assert "τ̂ from training, held-out replies decoded | τ̂ ÷ τ |" in table
    for r in measured:  # the train stage's held-out tau_hat for k drafts, beside the tau measured with k
        assert r["tau_hat_train"], "the held-out split gives tau_hat for every k the stage measures"
        assert f"| {float(r['tau_hat_train']) / float(r['tau']):.3f} |" in table
    for rule in ["target", "widen", "data", "tokenize", "capture", "vocab", "train", "export", "acceptance",
                 "acceptance_unwidened", "report", "bench/all.round0", "bench/all.round1"]:  # fmt: skip
        assert (work / f"results/logs/{rule}.log").exists(), rule
    for r in (0, 1):
        rows = list(csv.DictReader((work / f"results/bench/all/round{r}.csv").open()))
        # one row per variant, level (2 closed, 1 open) and block; every ratio divides by the same turn's no-spec block
        assert len(rows) == 4 * 3 * 2 and {row["variant"] for row in rows} == {"nospec", "always", "auto", "gate_2"}
        for row in rows:
            assert float(row["ratio"]) == pytest.approx(float(row["output_throughput"]) / float(row["baseline_output_throughput"]))
            assert row["design"] == "switched" and int(row["round"]) == r
        assert len((work / f"results/bench/all/round{r}.jsonl").read_text().splitlines()) >= len(rows)
    # rounds follow each other: round 1's job ran after round 0's
    assert (work / "results/bench/all/round1.csv").stat().st_mtime > (work / "results/bench/all/round0.csv").stat().st_mtime
    levels = (work / "results/report/levels.csv").read_text().splitlines()
    assert len(levels) == 1 + 4 * 2 and "output_throughput_lo" in levels[0]  # nospec, always, auto, gate_2
    rec = json.loads((work / "results/report/recommendation.json").read_text())
    assert rec["block_noise"] > 0 and set(rec["open_loop_best"]) == {"12.5"}
    for plot in ["training", "throughput", "latency", "envelope", "cost_model", "latency_throughput"]:
        assert (work / f"results/report/{plot}.png").read_bytes()[:4] == b"\x89PNG"
    # no server outlives the workflow
    assert "specgate.cli serve" not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout


def test_second_run_has_nothing_to_do(workdir):
    work, env = workdir
    assert "Nothing to be done" in snakemake(work, "-n", "results/report.md", env=env)


def test_capture_param_reruns_capture_and_nothing_upstream(workdir):
    work, env = workdir
    cfg_path = work / "config.yaml"
    original = cfg_path.read_text()
    cfg = yaml.safe_load(original)
    cfg["capture"]["dtype"] = "float32"
    cfg_path.write_text(yaml.safe_dump(cfg))
    try:
        planned = planned_jobs(snakemake(work, "-n", "results/report.md", env=env)) - {"all"}
        assert planned == {"capture"} | DOWNSTREAM_OF_CAPTURE
    finally:
        cfg_path.write_text(original)
    assert "Nothing to be done" in snakemake(work, "-n", "results/report.md", env=env)


DOWNSTREAM_OF_CAPTURE = {"train", "export", "acceptance", "acceptance_unwidened", "bench", "report"}


def test_online_capture_trains_from_the_tokens_and_writes_no_shards(workdir, tmp_path):
    """capture.mode online: the capture stage leaves the plan, training reads the tokenized set, runs the
    target on each batch, and the report says so."""
    work, env = workdir
    run = tmp_path / "online"
    for upstream in ("target", "target_widened", "data", "tokens", "vocab"):  # what training reads, and before
        shutil.copytree(work / "results" / upstream, run / "results" / upstream, symlinks=True)
    shutil.copy(work / "config.yaml", run / "config.yaml")
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["capture"]["mode"] = "online"
    cfg["bench"] |= {"auto": False, "concurrency": [1], "request_rates": [], "rounds": 1}
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    plan = planned_jobs(snakemake(run, "-n", "results/report.md", env=env))
    assert "capture" not in plan and {"train", "export", "report"} <= plan
    snakemake(run, "results/report.md", env=env)
    assert not (run / "results/capture").exists()
    assert "the target computed the hidden states of each training batch" in (run / "results/report.md").read_text()
    assert "Nothing to be done" in snakemake(run, "-n", "results/report.md", env=env)


@pytest.mark.parametrize(
    "module, stages",
    [
        ("pipeline/export", {"export", "acceptance", "acceptance_unwidened", "bench", "report"}),
        # the widened target is rebuilt; the drafter is widened by export, whose module imports this one
        ("model/widen", {"widen", "export", "acceptance", "acceptance_unwidened", "bench", "report"}),
        ("sweep/load_client", {"bench", "report"}),
        ("report/cost_model", {"report"}),
        ("report/uncertainty", {"report"}),
        ("pipeline/vocab", {"vocab"} | DOWNSTREAM_OF_CAPTURE),
        ("pipeline/capture", {"capture"} | DOWNSTREAM_OF_CAPTURE),
        # train imports capture (batch planning): editing either reruns training
        ("pipeline/train", DOWNSTREAM_OF_CAPTURE),
        # tokenize holds the tokenized-set reader that capture and vocab use
        ("pipeline/tokenize", {"tokenize", "capture", "vocab"} | DOWNSTREAM_OF_CAPTURE),
        # the chat helpers: the prompts of regeneration, acceptance and the servers, and tokenization
        ("model/chat", {"regenerate", "tokenize", "capture", "vocab"} | DOWNSTREAM_OF_CAPTURE),
        # a new data output makes every downstream stage rerun too
        ("pipeline/data", {"data", "regenerate", "tokenize", "capture", "vocab"} | DOWNSTREAM_OF_CAPTURE),
        ("engine/reference", {"bench", "report"}),
    ],
)
def test_editing_a_module_reruns_exactly_its_stages(workdir, module, stages):
    work, env = workdir
    source = work / "pkg/specgate" / f"{module}.py"
    original = source.read_text()
    source.write_text(original + "\n\ndef _edited_by_test():\n    return 1\n")
    try:
        jobs = planned_jobs(snakemake(work, "-n", "results/report.md", env=env))
    finally:
        source.write_text(original)
    assert jobs - {"all"} == stages
    # a comment-only edit is not a code change
    source.write_text(original + "\n# a comment\n")
    try:
        assert "Nothing to be done" in snakemake(work, "-n", "results/report.md", env=env)
    finally:
        source.write_text(original)


def reordered(obj):
    """The same data with every mapping's keys in reverse order."""
    if isinstance(obj, dict):
        return {k: reordered(obj[k]) for k in sorted(obj, reverse=True)}
    if isinstance(obj, list):
        return [reordered(v) for v in obj]
    return obj


@pytest.mark.parametrize("sort_keys", [True, False])
def test_the_same_config_in_another_key_order_reruns_nothing(workdir, sort_keys):
    work, env = workdir
    cfg_path = work / "config.yaml"
    original = cfg_path.read_text()
    cfg = yaml.safe_load(original)
    cfg_path.write_text(yaml.safe_dump(cfg if sort_keys else reordered(cfg), sort_keys=sort_keys))
    try:
        assert cfg_path.read_text() != original or sort_keys
        assert "Nothing to be done" in snakemake(work, "-n", "results/report.md", env=env)
    finally:
        cfg_path.write_text(original)


def test_unlock_works_as_snakemake_says(workdir):
    """After a killed run Snakemake says to run `snakemake --unlock`; it takes no --cores."""
    work, env = workdir
    locks = work / ".snakemake/locks"
    locks.mkdir(parents=True, exist_ok=True)
    (locks / "0.output.lock").write_text("results/report.md\n")  # as a killed run leaves it
    blocked = subprocess.run(
        [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(work), "--configfile",
         str(work / "config.yaml"), "--cores", "2", "--forcerun", "report", "results/report.md"],
        capture_output=True, text=True, env=env)  # fmt: skip
    assert blocked.returncode != 0 and "--unlock" in blocked.stdout + blocked.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(work), "--configfile",
         str(work / "config.yaml"), "--unlock"], capture_output=True, text=True, env=env)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert not locks.exists() or not any(locks.iterdir())
    assert "Nothing to be done" in snakemake(work, "-n", "results/report.md", env=env)


def test_a_new_threshold_reruns_the_switched_sweep_and_nothing_upstream(workdir):
    """The switched design's variants share one server's turns, so a new one reruns the sweep's jobs."""
    work, env = workdir
    cfg_path = work / "config.yaml"
    original = cfg_path.read_text()
    cfg = yaml.safe_load(original)
    cfg["bench"]["thresholds"] = [2, 3]
    cfg_path.write_text(yaml.safe_dump(cfg))
    try:
        out = snakemake(work, "-n", "results/report.md", env=env)
        assert planned_counts(out) == {"bench": 2, "report": 1}  # its two rounds
    finally:
        cfg_path.write_text(original)


def test_the_paired_design_runs_each_variant_beside_its_own_no_spec_server_and_a_new_one_alone(workdir, tmp_path):
    work, env = workdir
    copy = tmp_path / "paired"
    shutil.copytree(work, copy, symlinks=True, ignore=shutil.ignore_patterns("archive", "bench", "report*"))
    cfg = yaml.safe_load((copy / "config.yaml").read_text())
    cfg["bench"] |= {"design": "paired", "auto": False, "concurrency": [2], "request_rates": [], "rounds": 1}
    (copy / "config.yaml").write_text(yaml.safe_dump(cfg))
    snakemake(copy, "results/report.md", env=env)
    rows = {v: list(csv.DictReader((copy / f"results/bench/{v}/round0.csv").open())) for v in ("nospec", "always", "gate_2")}
    assert all(len(r) == 2 and all(x["design"] == "paired" for x in r) for r in rows.values())
    assert (copy / "results/logs/bench/gate_2.round0.baseline.server.log").exists()  # its own no-spec server
    report = (copy / "results/report.md").read_text()
    assert "Design **paired**" in report and "| nospec |" in report.split("beside it")[1]  # the A/A pair: noise floor
    cfg["bench"]["thresholds"] = [2, 3]
    (copy / "config.yaml").write_text(yaml.safe_dump(cfg))
    out = snakemake(copy, "-n", "results/report.md", env=env)
    assert planned_counts(out) == {"bench": 1, "report": 1} and "results/bench/gate_3/round0.csv" in out


def test_an_existing_drafter_and_the_target_in_place_go_to_the_report_without_training(workdir, tmp_path):
    """drafter.path: the drafter this run exported, copied elsewhere without specgate's files, as an
    operator's drafter would come; the hf_dir target is served from its own directory."""
    work, env = workdir
    theirs = tmp_path / "their_drafter"
    theirs.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(work / "results/drafter" / name, theirs / name)
    run = tmp_path / "run"
    run.mkdir()
    cfg = yaml.safe_load((work / "config.yaml").read_text())
    cfg["drafter"] = {"path": str(theirs)}
    cfg["bench"] |= {"auto": False, "concurrency": [1, 2], "request_rates": [], "rounds": 1}
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    plan = planned_jobs(snakemake(run, "-n", "results/report.md", env=env))
    assert plan == {"target", "widen", "data", "drafter", "acceptance", "acceptance_unwidened", "bench", "report"}
    snakemake(run, "results/report.md", env=env)
    # the target's files are its own, linked; the drafter's are the operator's, linked
    target = run / "results/target"
    assert (target / "model.safetensors").is_symlink() and (target / "config.json").resolve().parent == Path(cfg["target"]["path"]).resolve()
    assert json.loads((target / "manifest.json").read_text())["in_place"] is True
    assert (run / "results/drafter/model.safetensors").resolve() == theirs / "model.safetensors"
    for absent in ("tokenize", "capture", "vocab", "train", "export", "regenerate"):
        assert not (run / f"results/logs/{absent}.log").exists(), absent
    report = (run / "results/report.md").read_text()
    assert f"Taken from `{theirs}` (`drafter.path`)" in report and "## Drafter training" not in report
    assert "## Recommended threshold" in report and "## Deploy" in report
    rec = json.loads((run / "results/report/recommendation.json").read_text())
    launch = rec["launch"]
    # the verdict decides what is deployed: no speculation where it lost everywhere, else the pick
    assert launch["variant"] == ("nospec" if rec["verdict"] == "no speculation" or rec["pick"] is None else rec["pick"])
    printed = subprocess.run([sys.executable, "-m", "specgate.cli", "launch-line", str(run / "results/report/recommendation.json")],
                             capture_output=True, text=True, env=env, check=True).stdout  # fmt: skip
    assert printed.splitlines() == [launch["install"], launch["command"]] and launch["command"] in report
    # the served drafter, as a path relative to the run (so an archive's launch line holds elsewhere)
    assert "--draft results/drafter_widened " in launch["command"] or launch["variant"] == "nospec"
    assert (run / "results/report/training.png").exists() is False


def test_archive_rebuilds_the_same_report_elsewhere(workdir, tmp_path):
    work, env = workdir
    snakemake(work, env=env)  # the default target: report and archive
    assert "Nothing to be done" in snakemake(work, "-n", env=env)
    archives = list((work / "results/archive").glob("tiny-*.tar.gz"))
    assert len(archives) == 1
    proc = subprocess.run([sys.executable, "-m", "specgate.cli", "rebuild-report", str(archives[0]), str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    root = tmp_path / archives[0].name.removesuffix(".tar.gz")
    for meta in ["config.yaml", "pip-freeze.txt", "detailed-summary.tsv", "git.txt"]:
        assert (root / "meta" / meta).stat().st_size > 0, meta
    assert (root / "results/drafter_widened/model.safetensors").exists()  # the served drafter
    assert not (root / "results/target/model.safetensors").exists()  # the target is named by its manifest only
    rebuilt = (root / "results/report.md").read_text()
    archived = (root / "results/report.archived.md").read_text()
    tables = lambda text: [line for line in text.splitlines() if line.startswith("|")]  # noqa: E731
    assert len(tables(rebuilt)) > 40 and tables(rebuilt) == tables(archived)
    assert rebuilt == archived


def test_snakemake_report_packs_the_plots(workdir):
    work, env = workdir
    snakemake(work, "--report", str(work / "report.html"), env=env)
    html = (work / "report.html").read_text(errors="replace")
    for name in ["throughput.png", "envelope.png", "cost_model.png", "The envelope efficiency of a variant"]:
        assert name in html, name


@pytest.mark.parametrize("example", sorted(p.name for p in (REPO / "config/examples").glob("*.yaml")))
def test_every_example_config_plans_the_whole_chain(tmp_path, example):
    cfg = with_local_target_dir(yaml.safe_load((REPO / "config/examples" / example).read_text()), tmp_path)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    counts = planned_counts(snakemake(tmp_path, "-n"))
    bench = cfg["bench"]
    variants = 2 + len(bench.get("thresholds", [2, 4, 8])) + len(bench.get("hysteresis", [])) + bool(bench.get("auto"))
    variants += len(bench.get("steps0_thresholds", []))
    jobs = 1 if bench.get("design", "switched") == "switched" else variants
    assert counts["bench"] == jobs * bench.get("rounds", 1) and counts["report"] == counts["archive"] == 1
    assert {"capture", "train", "export", "acceptance"} <= set(counts)


def test_sglangs_own_adaptive_speculation_is_a_job_of_its_own_beside_the_switched_sweep(tmp_path):
    """It cannot be switched on the shared speculative server: the switched sweep keeps its one job (and its
    turns, so adding the comparison reruns nothing already measured), and the comparison gets a second."""
    cfg = with_local_target_dir(yaml.safe_load((REPO / "config/examples/h200-8bcost.yaml").read_text()), tmp_path)
    cfg["bench"]["sglang_adaptive"] = True
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    out = snakemake(tmp_path, "-n")
    assert planned_counts(out)["bench"] == 2
    assert "results/bench/all/round0.csv" in out and "results/bench/sglang_adaptive/round0.csv" in out


def _descendants(root: int) -> set[int]:
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid, rest = stat.read_text().split(" ", 1)
            parents[int(pid)] = int(rest.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(pid)
    return alive


def test_sigkill_of_snakemake_stops_the_bench_job_and_its_server(workdir, tmp_path):
    """Snakemake killed alone (SIGKILL, no signal reaches its jobs): the bench job must stop its
    server and exit within a few seconds, not run its levels to the end."""
    work, env = workdir
    copy = tmp_path / "copy"
    shutil.copytree(work, copy, symlinks=True, ignore=shutil.ignore_patterns("archive", "bench"))  # no old server logs
    cfg = yaml.safe_load((copy / "config.yaml").read_text())
    cfg["bench"] |= {"concurrency": [1], "window_s": 300, "rounds": 1}  # minutes of work
    (copy / "config.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen(
        [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(copy),
         "--configfile", str(copy / "config.yaml"), "--cores", "2", "results/bench/all/round0.csv"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)  # fmt: skip
    try:
        server_log = copy / "results/logs/bench/all.round0.server.log"
        deadline = time.monotonic() + 180
        while b"/v1/chat/completions" not in (server_log.read_bytes() if server_log.exists() else b""):
            assert proc.poll() is None and time.monotonic() < deadline, "the bench job did not start measuring"
            time.sleep(0.5)
        time.sleep(2)  # the level is running
        job = _descendants(proc.pid)
        assert any(b"serve" in Path(f"/proc/{p}/cmdline").read_bytes() for p in _alive(job)), "no server found"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 10
        while _alive(job) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = {p: Path(f"/proc/{p}/cmdline").read_bytes()[:120] for p in _alive(job)}
        assert not left, f"still running 10 s after Snakemake was killed: {left}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in _alive(_descendants(proc.pid)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
