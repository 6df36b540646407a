"""Export the trained drafter in the layout SGLang's LlamaForCausalLMEagle3 loads, and check it.

SGLang silently skips weights whose names it does not know, and a drafter loaded that
way accepts almost nothing. `check_draft` therefore verifies names, shapes, dtypes and
config fields against the target and reports every violation precisely.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specgate.files import atomic_path, write_json

WEIGHT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
ROPE_KEYS = ("rope_parameters", "rope_scaling", "rope_theta")


class DraftContractError(ValueError):
    pass


def expected_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, ht, inter = cfg["hidden_size"], cfg["target_hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    n_aux = len(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    return {
        "fc.weight": (h, n_aux * ht),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (heads * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, heads * hd),
        "midlayer.mlp.gate_proj.weight": (inter, h),
        "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
        "norm.weight": (h,),
        "lm_head.weight": (cfg["draft_vocab_size"], h),
        "d2t": (cfg["draft_vocab_size"],),
        "t2d": (cfg["vocab_size"],),
    }


def export_drafter(weights: str, out_dir: str, target_dir: str, dtype: str = "bfloat16", *,
                   widened_target: str | None = None, widened_out: str | None = None) -> dict:  # fmt: skip
    """Write config.json and model.safetensors to out_dir, then run the contract check on it.

    With `widened_target` (target.widen), also write the drafter widened to that target's shape
    to `widened_out`, checked against the widened target."""
    with safe_open(weights, framework="pt") as f:
        cfg = json.loads(f.metadata()["config"])
        state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118  (safe_open is not a dict)
    tensors = {}
    for name in expected_shapes(cfg):
        t = state[name]
        tensors[name] = t.to(torch.int64) if name == "d2t" else t.bool() if name == "t2d" else t.to(WEIGHT_DTYPES[dtype])
    cfg["torch_dtype"] = cfg["dtype"] = dtype
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        write_json(tmp / "config.json", cfg)
        check_draft(tmp, target_dir)
    if widened_target:
        widen_drafter(out_dir, widened_out, widened_target)
    return cfg


def widen_drafter(draft_dir: str, out_dir: str, target_dir: str) -> dict:
    """Write the drafter of `draft_dir` widened to the shape of the widened target in `target_dir`
    (`specgate.model.widen`), and run the contract check against that target."""
    from specgate.model.widen import Widening, widen_drafter_tensors, widened_drafter_config

    cfg = json.loads((Path(draft_dir) / "config.json").read_text())
    to = Widening.of(json.loads((Path(target_dir) / "config.json").read_text()))
    with safe_open(str(Path(draft_dir) / "model.safetensors"), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118  (safe_open is not a dict)
    tensors = widen_drafter_tensors(state, cfg, to)
    wide = widened_drafter_config(cfg, to)
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        write_json(tmp / "config.json", wide)
        check_draft(tmp, target_dir)
    return wide


def check_draft(draft_dir: str | Path, target_dir: str | Path) -> list[str]:
    """Raise DraftContractError listing every way draft_dir differs from what SGLang expects."""
    draft_dir, target_dir = Path(draft_dir), Path(target_dir)
    problems: list[str] = []
    try:
        cfg = json.loads((draft_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DraftContractError(f"{draft_dir / 'config.json'}: unreadable ({e})") from e
    target = json.loads((target_dir / "config.json").read_text())

    def want(key, expected):
        if cfg.get(key) != expected:
            problems.append(f"config.json: {key} is {cfg.get(key)!r}, expected {expected!r}")

    want("architectures", ["LlamaForCausalLMEagle3"])
    want("model_type", "llama")
    want("num_hidden_layers", 1)
    want("tie_word_embeddings", False)
    want("vocab_size", target["vocab_size"])
    want("target_hidden_size", target["hidden_size"])
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size"):
        want(key, target[key])
    for key in ROPE_KEYS:
        if key in target or key in cfg:
            want(key, target.get(key))
    if not isinstance(cfg.get("draft_vocab_size"), int) or not 0 < cfg["draft_vocab_size"] <= target["vocab_size"]:
        problems.append(f"config.json: draft_vocab_size {cfg.get('draft_vocab_size')!r} is not in 1..{target['vocab_size']}")
    layer_ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    n_layers = target["num_hidden_layers"]
    if not (isinstance(layer_ids, list) and len(layer_ids) == 3 and all(isinstance(i, int) and 0 <= i < n_layers for i in layer_ids)):
        problems.append(f"config.json: eagle_config.eagle_aux_hidden_state_layer_ids {layer_ids!r} must be 3 layer ids in 0..{n_layers - 1} (SGLang numbering)")
    if problems:  # shapes below depend on these fields
        raise DraftContractError(_report(draft_dir, problems))

    weights_path = draft_dir / "model.safetensors"
    if not weights_path.exists():
        raise DraftContractError(_report(draft_dir, [f"{weights_path.name}: missing"]))
    expected = expected_shapes(cfg)
    # what SGLang also loads: the drafter's own embedding (SpecForge saves one), and the layer under
    # its newer name (layers.0 for midlayer)
    optional = {"embed_tokens.weight": (cfg["vocab_size"], cfg["hidden_size"])}
    with safe_open(str(weights_path), framework="pt") as f:
        stored = {n.replace("layers.0.", "midlayer.", 1) if n.startswith("layers.0.") else n: n for n in f.keys()}  # noqa: SIM118
        names = set(stored)
        expected |= {n: shape for n, shape in optional.items() if n in names}
        tensors = {n: f.get_tensor(stored[n]) for n in names & set(expected)}
    for name in sorted(names - set(expected)):
        problems.append(f"model.safetensors: unexpected tensor {name!r} (SGLang would silently ignore it)")
    for name in sorted(set(expected) - names):
        problems.append(f"model.safetensors: missing tensor {name!r}")
    float_dtypes = set()
    for name, t in sorted(tensors.items()):
        if tuple(t.shape) != expected[name]:
            problems.append(f"model.safetensors: {name} has shape {tuple(t.shape)}, expected {expected[name]}")
        if name == "d2t" and t.dtype != torch.int64:
            problems.append(f"model.safetensors: d2t has dtype {t.dtype}, expected torch.int64 (offsets)")
        elif name == "t2d" and t.dtype != torch.bool:
            problems.append(f"model.safetensors: t2d has dtype {t.dtype}, expected torch.bool")
        elif name not in ("d2t", "t2d"):
            if not t.is_floating_point():
                problems.append(f"model.safetensors: {name} has dtype {t.dtype}, expected a floating dtype")
            float_dtypes.add(t.dtype)
    if len(float_dtypes) > 1:
        problems.append(f"model.safetensors: mixed weight dtypes {sorted(map(str, float_dtypes))}")
    if not problems and "d2t" in tensors and "t2d" in tensors:
        ids = torch.arange(len(tensors["d2t"])) + tensors["d2t"]
        if int(ids.min()) < 0 or int(ids.max()) >= target["vocab_size"] or not bool((ids[1:] > ids[:-1]).all()):
            problems.append("model.safetensors: d2t offsets do not map draft ids to distinct ascending target ids")
        elif not bool(tensors["t2d"][ids].all()) or int(tensors["t2d"].sum()) != len(ids):
            problems.append("model.safetensors: t2d does not mark exactly the target ids that d2t maps to")
    if problems:
        raise DraftContractError(_report(draft_dir, problems))
    return []


def _report(draft_dir, problems: list[str]) -> str:
    return f"draft {draft_dir} violates the SGLang EAGLE-3 contract:\n  " + "\n  ".join(problems)
