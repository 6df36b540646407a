"""The SGLang path of the regenerate stage against the real SGLang 0.5.15 source, on CPU.

SGLang's engine needs a GPU, so these tests read its source (syntax trees) for the names
the stage uses, and run its SamplingParams (pure Python) on the parameters the stage sends.
"""

import ast
import importlib.util
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, sglang_dirs

from specgate.pipeline import regenerate
from specgate.pipeline.regenerate import sglang_engine_args, sglang_sampling_params

PLUGIN_TESTS = REPO / "tests" / "unit" / "sglang_plugin"  # cpu_stubs: lets SGLang import on CPU
VERSION = "0.5.15"


def package_dir(sglang_dir: str | None) -> Path:
    if sglang_dir:
        return Path(sglang_dir) / "sglang"
    return Path(importlib.util.find_spec("sglang").origin).parent


def version(package: Path) -> str | None:
    for node in ast.parse((package / "_version.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
            return node.value.value
    return None


SOURCES = [d for d in sglang_dirs() if version(package_dir(d)) == VERSION]


def tree(package: Path, module: str) -> ast.Module:
    return ast.parse((package / module).read_text())


def class_def(module: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in module.body if isinstance(n, ast.ClassDef) and n.name == name)


def method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    return next(n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name)


def module_value(module: ast.Module, name: str):
    node = next(n for n in module.body if isinstance(n, ast.Assign) and any(getattr(t, "id", None) == name for t in n.targets))
    return ast.literal_eval(node.value)


def calls_on(attribute: str, method_name: str) -> list[ast.Call]:
    """Calls `<...>.<attribute>.<method_name>(...)` in the regenerate stage's own source."""
    source = ast.parse(inspect.getsource(regenerate))
    return [n for n in ast.walk(source) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == method_name and getattr(n.func.value, "attr", None) == attribute]  # fmt: skip


needs_source = pytest.mark.parametrize(
    "sglang_dir", SOURCES or [pytest.param(None, marks=pytest.mark.skip(f"no SGLang {VERSION} source"))]
)


@needs_source
def test_engine_is_sglang_Engine_and_takes_the_stages_server_args(sglang_dir):
    package = package_dir(sglang_dir)
    # sglang.Engine is the offline engine class, whose __init__ builds ServerArgs(**kwargs)
    init = tree(package, "__init__.py")
    lazy = next(n.value for n in init.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "Engine")
    assert [a.value for a in lazy.args] == ["sglang.srt.entrypoints.engine", "Engine"]
    engine = class_def(tree(package, "srt/entrypoints/engine.py"), "Engine")
    assert method(engine, "__init__").args.kwarg.arg == "kwargs"
    server_args = tree(package, "srt/server_args.py")
    fields = {n.target.id for n in class_def(server_args, "ServerArgs").body if isinstance(n, ast.AnnAssign)}
    args = sglang_engine_args("/target", mem_fraction_static=0.8, seed=0)
    assert set(args) <= fields, set(args) - fields
    assert args["attention_backend"] in module_value(server_args, "ATTENTION_BACKEND_CHOICES")
    assert args["sampling_backend"] in module_value(server_args, "SAMPLING_BACKEND_CHOICES")
    assert args["grammar_backend"] in module_value(server_args, "GRAMMAR_BACKEND_CHOICES")


@needs_source
def test_generate_and_shutdown_as_the_stage_calls_them(sglang_dir):
    engine = class_def(tree(package_dir(sglang_dir), "srt/entrypoints/engine.py"), "Engine")
    generate = method(engine, "generate").args
    parameters = {a.arg for a in generate.args + generate.kwonlyargs}
    calls = calls_on("engine", "generate")
    assert len(calls) == 1 and not calls[0].args  # keywords only: the signature's order is not relied on
    used = {k.arg for k in calls[0].keywords}
    assert used == {"input_ids", "sampling_params"} and used <= parameters
    shutdown = method(engine, "shutdown").args
    assert [a.arg for a in shutdown.args] == ["self"] and len(calls_on("engine", "shutdown")) == 1


@needs_source
def test_a_finished_token_id_output_carries_output_ids(sglang_dir):
    """With skip_tokenizer_init the tokenizer manager answers a finished request with
    {"output_ids", "meta_info"}: the stage reads "output_ids" from each result."""
    manager = tree(package_dir(sglang_dir), "srt/managers/tokenizer_manager.py")
    handler = method(class_def(manager, "TokenizerManager"), "_handle_batch_output")
    shapes = [{k.value for k in d.keys if isinstance(k, ast.Constant)} for d in ast.walk(handler) if isinstance(d, ast.Dict)]
    assert {"output_ids", "meta_info"} in shapes


@needs_source
def test_sglangs_sampling_params_accept_the_stages_and_decode_greedily(sglang_dir):
    """SGLang's own SamplingParams, run on CPU: verified and normalised as the scheduler does
    without a tokenizer (skip_tokenizer_init); temperature 0 becomes greedy (top_k 1)."""
    eos = frozenset({2, 7})
    check = (
        "import json, sys\n"
        "import cpu_stubs\n"
        "from sglang.srt.sampling.sampling_params import SamplingParams\n"
        "out = []\n"
        "for params in json.loads(sys.argv[1]):\n"
        "    p = SamplingParams(**params)\n"
        "    p.verify(49152)\n"
        "    p.normalize(None)\n"
        "    out.append([p.max_new_tokens, p.temperature, p.top_k, sorted(p.stop_token_ids), p.ignore_eos])\n"
        "print('RESULT', json.dumps(out))\n"
    )
    params = [sglang_sampling_params(max_new_tokens=128, temperature=t, eos=eos) for t in (0.0, 0.7)]
    path = [sglang_dir] if sglang_dir else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*path, str(PLUGIN_TESTS), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", check, json.dumps(params)], capture_output=True, text=True, env=env,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    greedy, sampled = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert greedy == [128, 1.0, 1, [2, 7], False]
    assert sampled[:2] == [128, 0.7] and sampled[2] > 1 and sampled[3:] == [[2, 7], False]


@needs_source
def test_starting_the_engine_forces_its_own_root_logging(sglang_dir):
    """Why the stage restores its logging after sglang.Engine(): the engine's launch calls
    configure_logger, which runs logging.basicConfig(force=True)."""
    package = package_dir(sglang_dir)
    engine = tree(package, "srt/entrypoints/engine.py")
    assert any(isinstance(n, ast.Call) and getattr(n.func, "id", None) == "configure_logger" for n in ast.walk(engine))
    configure = next(n for n in tree(package, "srt/utils/common.py").body
                     if isinstance(n, ast.FunctionDef) and n.name == "configure_logger")  # fmt: skip
    basic = [n for n in ast.walk(configure) if isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "basicConfig"]
    assert [(k.arg, k.value.value) for b in basic for k in b.keywords if k.arg == "force"] == [("force", True)]
