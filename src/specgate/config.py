"""Validate a workflow config against the JSON schema, fill defaults, and name the bad key."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import yaml
from jsonschema import Draft202012Validator, ValidationError, validators

# Ships inside the package, so `specgate validate-config` works from an installed wheel.
SCHEMA = Path(__file__).with_name("config.schema.yaml")


class ConfigError(ValueError):
    """A config problem, with the offending key in dotted form."""


def _key(path) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<root>"


def _with_defaults(base):
    """A validator class that also writes schema defaults into the instance."""
    validate_props = base.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, sub in properties.items():
                if "default" in sub and name not in instance:
                    instance[name] = copy.deepcopy(sub["default"])
        yield from validate_props(validator, properties, instance, schema)

    def existing_path(validator, wanted, instance, schema):
        if wanted and isinstance(instance, str) and not os.path.exists(instance):
            yield ValidationError(f"path does not exist: {instance!r} (cwd {os.getcwd()})")

    return validators.extend(base, {"properties": set_defaults, "x-existing-path": existing_path})


_Validator = _with_defaults(Draft202012Validator)


def _message(err) -> str:
    key = _key(err.absolute_path)
    if err.validator == "additionalProperties":
        extra = sorted(set(err.instance) - set(err.schema.get("properties", {})))
        return "; ".join(f"config key '{_key([*err.absolute_path, e])}': unknown key" for e in extra)
    if err.validator == "required":
        missing = err.message.split("'")[1]
        return f"config key '{_key([*err.absolute_path, missing])}': required but missing"
    return f"config key '{key}': {err.message}"


def in_place_problem(path: str | os.PathLike, dtype: str) -> str | None:
    """Why the checkpoint at `path` cannot be served in place with `target.dtype`, or None."""
    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        return f"{cfg_path} is missing: not a Hugging Face model directory"
    cfg = json.loads(cfg_path.read_text())
    if not any(path.glob("*.safetensors")):
        bins = sorted(p.name for p in path.glob("*.bin"))
        return f"{path} has no *.safetensors weights{f' (it has {bins}: save them as safetensors)' if bins else ''}"
    tok = path / "tokenizer_config.json"
    if not (path / "chat_template.jinja").is_file() and not (
        tok.is_file() and json.loads(tok.read_text()).get("chat_template")
    ):
        return f"{path} has no chat template (tokenizer_config.json or chat_template.jinja); the data stages need one"
    if not any(a.endswith("ForCausalLM") for a in cfg.get("architectures") or []):
        return f"{cfg_path}: architectures {cfg.get('architectures')} has no *ForCausalLM"
    stored = str(cfg.get("torch_dtype") or cfg.get("dtype") or "")
    if dtype not in ("auto", stored):
        return (f"target.dtype is {dtype} but the checkpoint is stored as {stored or 'an unknown dtype'}; a target "
                f"is served in place, as stored: set target.dtype to auto")  # fmt: skip
    return None



MIN_EXPECTED_ARRIVALS = 10  # a block of fewer would often draw none (e^-10: never)


def _semantic_checks(config: dict) -> list[str]:
    errors = []
    target = config["target"]
    if target["source"] == "hf_dir" and not target.get("path"):
        errors.append("config key 'target.path': required when target.source is hf_dir")
    elif target["source"] == "hf_dir" and (problem := in_place_problem(target["path"], target["dtype"])):
        errors.append(f"config key 'target.path': {problem}")
    if target["source"] == "hf_cache" and not target.get("model_id"):
        errors.append("config key 'target.model_id': required when target.source is hf_cache")
    sources = config["data"]["sources"]
    names = [s["name"] for s in sources]
    for i, src in enumerate(sources):
        if names.count(src["name"]) > 1:
            errors.append(f"config key 'data.sources[{i}].name': duplicate source name {src['name']!r}")
        if src["kind"] in ("jsonl", "datasets") and not src.get("path"):
            errors.append(f"config key 'data.sources[{i}].path': required for kind {src['kind']}")
    if not any(s["train"] for s in sources):
        errors.append("config key 'data.sources': no source has train > 0")
    f = config["data"]["filters"]
    if f["max_turns"] is not None and f["min_turns"] > f["max_turns"]:
        errors.append("config key 'data.filters.min_turns': larger than data.filters.max_turns")
    regen = config["data"]["regenerate"]
    if regen["replicas"] > 1 and regen["temperature"] == 0:
        errors.append("config key 'data.regenerate.replicas': copies of greedy replies are identical; set data.regenerate.temperature > 0")
    layers = config["capture"]["layers"]
    if layers is not None and len(set(layers)) != len(layers):
        errors.append("config key 'capture.layers': layers must be distinct")
    bench = config["bench"]
    for i, (disable_at, enable_at) in enumerate(bench["hysteresis"]):
        if enable_at >= disable_at:
            errors.append(f"config key 'bench.hysteresis[{i}]': enable_at {enable_at} must be below disable_at {disable_at}")
    if bench["steps0_thresholds"] and config["serve"]["engine"] != "sglang":
        errors.append("config key 'bench.steps0_thresholds': SGLang's 0-step path exists only with serve.engine sglang")
    if bench["sglang_adaptive"] and config["serve"]["engine"] != "sglang":
        errors.append("config key 'bench.sglang_adaptive': SGLang's adaptive speculation exists only with serve.engine sglang")
    if bench["auto"] and config["serve"]["engine"] == "sglang" and config["serve"]["tp"] > 1:
        errors.append("config key 'bench.auto': the auto gate needs serve.tp 1 (each tensor-parallel rank would "
                      "time its own steps and decide alone)")
    if bench["design"] == "switched":
        if bench["steps0_thresholds"]:
            errors.append("config key 'bench.steps0_thresholds': SGLang's 0-step path cannot be switched at run time; "
                          "set bench.design: paired to sweep it")  # fmt: skip
        if config["serve"]["engine"] == "sglang" and config["serve"]["tp"] > 1:
            errors.append("config key 'bench.design': switched needs serve.tp 1 (each tensor-parallel rank would "
                          "read the switch at a different step); set bench.design: paired")  # fmt: skip
    for i, rate in enumerate(bench["request_rates"]):  # a Poisson window expecting few arrivals may draw none
        if rate * bench["rate_window_s"] < MIN_EXPECTED_ARRIVALS:
            errors.append(f"config key 'bench.request_rates[{i}]': {rate:g}/s for bench.rate_window_s "
                          f"{bench['rate_window_s']:g} s expects {rate * bench['rate_window_s']:.1f} requests a block; "
                          f"a block needs at least {MIN_EXPECTED_ARRIVALS}")  # fmt: skip
    if bench["concurrency"] != sorted(set(bench["concurrency"])):
        errors.append("config key 'bench.concurrency': levels must be distinct and increasing")
    if max(bench["concurrency"]) > config["serve"]["max_running"]:
        errors.append(f"config key 'bench.concurrency': level {max(bench['concurrency'])} exceeds serve.max_running "
                      f"{config['serve']['max_running']}")  # fmt: skip
    return errors


def validate_config(config: dict, schema_path: str | os.PathLike = SCHEMA) -> dict:
    """Return a validated copy of `config` with defaults filled in; raise ConfigError naming every bad key."""
    schema = yaml.safe_load(Path(schema_path).read_text())
    config = copy.deepcopy(config)
    errors = sorted(_Validator(schema).iter_errors(config), key=lambda e: list(map(str, e.absolute_path)))
    messages = [_message(e) for e in errors]
    if not messages:
        messages = _semantic_checks(config)
    if messages:
        raise ConfigError("invalid config:\n  " + "\n  ".join(messages))
    # Defaults that follow other keys. The drafter is trained for as many steps as are served:
    # a longer training-time test costs time per step and buys nothing at the served k.
    if config["train"]["ttt_length"] is None:
        config["train"]["ttt_length"] = config["serve"]["num_steps"]
    return config


def check_gpu_count(config: dict, visible: int | None = None) -> None:
    """Refuse, before any work, a stage that asks for more GPUs than this host shows.

    `visible` is the number of GPUs torch sees (CUDA_VISIBLE_DEVICES applied); found here
    only when a stage asks for more than one process, so CPU configs never import torch.
    """
    asks = {f"{stage}.num_processes": config[stage]["num_processes"] for stage in ("capture", "train")}
    asks = {key: n for key, n in asks.items() if isinstance(n, int) and n > 1}
    if not asks or config["device"] == "cpu":
        return
    if visible is None:
        import torch

        visible = torch.cuda.device_count()
    if visible == 0:  # no GPU: the ranks are CPU processes (gloo), which any host can run
        return
    for key, n in asks.items():
        if n > visible:
            cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
            shown = f" (CUDA_VISIBLE_DEVICES={cvd})" if cvd is not None else ""
            raise ConfigError(f"config key '{key}': {n} processes, one per GPU, but {visible} GPU"
                              f"{'s are' if visible != 1 else ' is'} visible{shown}")  # fmt: skip


def load_config(path: str | os.PathLike, schema_path: str | os.PathLike = SCHEMA) -> dict:
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    return validate_config(raw, schema_path)
