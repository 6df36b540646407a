"""Real Snakemake runs on a tiny config: full chain, no-op rerun, and rerun granularity."""

import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml
from conftest import REPO, write_conversations

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


def planned_jobs(output: str) -> set[str]:
    """Rule names in the 'Job stats' table of a dry run."""
    if "Nothing to be done" in output:
        return set()
    table = output.split("Job stats:")[1].split("total")[0]
    return {m.group(1) for m in re.finditer(r"^(\w+)\s+\d+\s*$", table, re.M)} - {"job"}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny_llama_dir):
    work = tmp_path_factory.mktemp("workflow")
    chats = write_conversations(work / "chats.jsonl", 60)
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    config["run_name"] = "tiny"
    config["device"] = "cpu"
    config["target"] = {"source": "hf_dir", "path": str(tiny_llama_dir), "dtype": "float32"}
    config["data"]["sources"] = [
        {"name": "chats", "kind": "jsonl", "path": str(chats), "train": 40, "eval": 10},
        {"name": "humaneval", "kind": "humaneval", "train": 8, "eval": 4},
    ]
    config["tokenize"]["max_length"] = 128
    config["capture"] |= {"batch_tokens": 512, "shard_tokens": 2048}
    config["vocab"]["draft_vocab_size"] = 512
    config["train"] |= {"ttt_length": 2, "epochs": 1, "batch_tokens": 1024, "checkpoint_every": 5}
    config["acceptance"] |= {"num_steps": [2], "max_new_tokens": 8, "prompts_per_source": 2, "batch_size": 2}
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
                 "results/drafter/model.safetensors", "results/acceptance.csv", "results/report.md"]:  # fmt: skip
        assert (work / path).exists(), path
    report = (work / "results/report.md").read_text()
    for section in ["## Hidden-state capture", "## Draft vocabulary", "## Drafter training", "## Acceptance length"]:
        assert section in report
    for rule in ["target", "prepare_data", "tokenize", "capture", "vocab", "train", "export", "acceptance", "report"]:
        assert (work / f"results/logs/{rule}.log").exists(), rule


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


DOWNSTREAM_OF_CAPTURE = {"train", "export", "acceptance", "report"}


@pytest.mark.parametrize(
    "module, stages",
    [
        ("export", {"export", "acceptance", "report"}),
        ("vocab", {"vocab"} | DOWNSTREAM_OF_CAPTURE),
        ("capture", {"capture"} | DOWNSTREAM_OF_CAPTURE),
        # train.py imports capture (batch planning): editing either reruns training
        ("train", DOWNSTREAM_OF_CAPTURE),
        # chat.py holds tokenization and the tokenized-set reader that capture and vocab use
        ("chat", {"tokenize", "capture", "vocab"} | DOWNSTREAM_OF_CAPTURE),
        # a new prepare_data output makes every downstream stage rerun too
        ("data", {"prepare_data", "tokenize", "capture", "vocab"} | DOWNSTREAM_OF_CAPTURE),
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
