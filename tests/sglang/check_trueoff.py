"""Run in a subprocess against a real SGLang on PYTHONPATH: load plugins in true-off mode, list the hooks."""

import importlib.machinery
import json
import logging
import sys
import types

logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")
tv, tv_io = types.ModuleType("torchvision"), types.ModuleType("torchvision.io")
tv_io.decode_jpeg = lambda *a, **k: None
tv.io = tv_io
tv.__spec__ = importlib.machinery.ModuleSpec("torchvision", None)
tv_io.__spec__ = importlib.machinery.ModuleSpec("torchvision.io", None)
sys.modules.update({"torchvision": tv, "torchvision.io": tv_io})

import sglang  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: E402

load_plugins()
hooks = {target: [t.value for t, _, _ in entries] for target, entries in HookRegistry._hooks.items()}
print("RESULT", json.dumps({"version": sglang.__version__, "hooks": hooks}))
