"""Run in a subprocess against a real SGLang on PYTHONPATH: load plugins in true-off mode, list the hooks."""

import json

import cpu_stubs  # noqa: F401  (first: lets SGLang import on CPU)
import sglang  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: E402

load_plugins()
hooks = {target: [t.value for t, _, _ in entries] for target, entries in HookRegistry._hooks.items()}
print("RESULT", json.dumps({"version": sglang.__version__, "hooks": hooks}))
