import copy
import os
import re
import subprocess
import sys
import zipfile

import pytest
import yaml
from conftest import REPO, with_local_target_dir

from specgate.config import SCHEMA, ConfigError, check_gpu_count, load_config, validate_config


@pytest.fixture
def default():
    return yaml.safe_load((REPO / "config/config.yaml").read_text())


def test_default_config_is_valid_and_complete(default):
    cfg = validate_config(default, SCHEMA)
    assert cfg["target"]["source"] == "gguf_wheel"
    assert cfg["capture"]["batch_tokens"] > 0


def test_every_example_config_is_valid(tmp_path):
    for path in sorted((REPO / "config/examples").glob("*.yaml")):
        cfg = with_local_target_dir(yaml.safe_load(path.read_text()), tmp_path)
        (tmp_path / path.name).write_text(yaml.safe_dump(cfg))
        load_config(tmp_path / path.name, SCHEMA)


def _overlay(base: dict, over: dict) -> dict:
    """Snakemake's merge of a later --configfile over an earlier one: nested keys replace one by one."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _overlay(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _took(merged, over) -> bool:
    """Every value `over` sets is in `merged`; validation may add defaults beside them, also in list items."""
    if isinstance(over, dict):
        return isinstance(merged, dict) and all(k in merged and _took(merged[k], v) for k, v in over.items())
    if isinstance(over, list) and over and isinstance(over[0], dict):
        return isinstance(merged, list) and len(merged) == len(over) and all(map(_took, merged, over))
    return merged == over


def test_took_sees_a_missing_or_changed_value():
    assert _took({"a": [{"x": 1, "y": 2}], "b": 3}, {"a": [{"x": 1}]})
    assert not _took({"a": [{"x": 1}]}, {"a": [{"x": 2}]})
    assert not _took({"a": [{"x": 1}]}, {"a": [{"x": 1}, {"x": 1}]})
    assert not _took({"a": {"b": 1}}, {"a": {"c": 1}})


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "config/overlays").glob("*.yaml")))
def test_every_overlay_over_the_config_its_usage_line_names_is_valid(name):
    text = (REPO / "config/overlays" / name).read_text()
    usage = re.search(r"--configfile (.+)", text)
    assert usage, f"{name} has no usage line naming the config it goes over"
    files = usage.group(1).split()  # the config, then each overlay in the order Snakemake merges them
    assert files[-1] == f"config/overlays/{name}", f"{name}'s usage line ends with another file"
    over = yaml.safe_load(text)
    merged = yaml.safe_load((REPO / files[0]).read_text())
    for earlier in files[1:-1]:
        merged = _overlay(merged, yaml.safe_load((REPO / earlier).read_text()))
    merged = validate_config(_overlay(merged, over), SCHEMA)
    assert _took(merged, over)  # every key the overlay sets took


def test_all_data_and_all_turns_are_valid(default):
    cfg = copy.deepcopy(default)
    cfg["data"]["sources"][0]["train"] = "all"
    cfg["data"]["filters"]["max_turns"] = None
    cfg["data"]["regenerate"] |= {"enabled": True, "temperature": 0.7, "replicas": 2}
    validate_config(cfg, SCHEMA)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c["capture"].update(batch_tokens="many"), "config key 'capture.batch_tokens': 'many' is not of type 'integer'"),
        (lambda c: c["capture"].update(bacth_tokens=4), "config key 'capture.bacth_tokens': unknown key"),
        (lambda c: c.update(extra={}), "config key 'extra': unknown key"),
        (lambda c: c.pop("vocab"), "config key 'vocab': required but missing"),
        (lambda c: c["data"]["sources"][1].update(kind="csv"), "config key 'data.sources[1].kind': 'csv' is not one of"),
        (lambda c: c["data"]["sources"][0].update(path="/no/such/file.json"), "config key 'data.sources[0].path': path does not exist"),
        (lambda c: c["target"].update(source="hf_dir"), "config key 'target.path': required when target.source is hf_dir"),
        (lambda c: c["vocab"].update(draft_vocab_size=0), "config key 'vocab.draft_vocab_size': 0 is less than the minimum"),
        (lambda c: (c["serve"].update(engine="sglang", tp=2), c["bench"].update(auto=True)),
         "config key 'bench.auto': the auto gate needs serve.tp 1"),
        (lambda c: c["bench"].update(sglang_adaptive=True),
         "config key 'bench.sglang_adaptive': SGLang's adaptive speculation exists only with serve.engine sglang"),
        (lambda c: c["data"]["regenerate"].update(replicas=4),
         "config key 'data.regenerate.replicas': copies of greedy replies are identical"),
        (lambda c: c["data"]["sources"][0].update(train="most"), "config key 'data.sources[0].train': 'most' is not valid"),
        (lambda c: c["bench"].update(request_rates=[8, 0.5], rate_window_s=10),
         "config key 'bench.request_rates[1]': 0.5/s for bench.rate_window_s 10 s expects 5.0 requests a block"),
    ],
)
def test_errors_name_the_key(default, edit, message):
    cfg = copy.deepcopy(default)
    edit(cfg)
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, SCHEMA)
    assert message in str(err.value)


def test_snakemake_refuses_a_bad_config_before_any_job(tmp_path, default):
    cfg = copy.deepcopy(default)
    cfg["capture"]["shard_tokens"] = -1
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(tmp_path),
         "--configfile", str(tmp_path / "bad.yaml"), "--cores", "1"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "config key 'capture.shard_tokens': -1 is less than the minimum of 1" in proc.stdout + proc.stderr
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("stage", ["capture", "train"])
def test_more_processes_than_gpus_is_a_config_error(default, stage):
    cfg = validate_config(default)
    cfg["device"], cfg[stage]["num_processes"] = "cuda", 2
    with pytest.raises(ConfigError, match=rf"config key '{stage}.num_processes': 2 processes, one per GPU, but 1 GPU is visible"):
        check_gpu_count(cfg, visible=1)
    check_gpu_count(cfg, visible=2)  # enough GPUs
    check_gpu_count(cfg, visible=0)  # no GPU: the ranks are CPU processes
    cfg["device"] = "cpu"
    check_gpu_count(cfg, visible=1)  # CPU ranks asked for explicitly


def test_snakemake_refuses_more_processes_than_gpus_before_any_job(tmp_path, default):
    """One line naming the key, before any job, on a host whose torch sees one GPU."""
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake/sitecustomize.py").write_text("import torch\ntorch.cuda.device_count = lambda: 1\n")
    cfg = copy.deepcopy(default)
    cfg["device"] = "cuda"
    cfg["train"]["num_processes"] = 2
    (tmp_path / "two.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(tmp_path),
         "--configfile", str(tmp_path / "two.yaml"), "--cores", "1"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(tmp_path / "fake")},
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "config key 'train.num_processes': 2 processes, one per GPU, but 1 GPU is visible" in out
    assert "Traceback" not in out and not (tmp_path / "results").exists()


def test_validate_config_works_from_an_installed_wheel(tmp_path):
    """The schema ships inside the package: no checkout needed."""
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(tmp_path / "dist"), str(REPO)], capture_output=True, text=True)  # fmt: skip
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("specgate-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    (tmp_path / "cfg.yaml").write_text((REPO / "config/config.yaml").read_text())
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ["pipeline/train.py", "model/llama.py", "engine/server.py", "sglang/plugin.py", "sweep/bench.py",
                   "report/report.py", "config.schema.yaml"]:  # fmt: skip
        assert f"specgate/{module}" in names, module
    proc = subprocess.run([sys.executable, "-c", "import sys; from specgate.cli import main; sys.exit(main())",
                           "validate-config", "cfg.yaml"], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(site)})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "cfg.yaml: valid"
