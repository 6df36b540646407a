"""Run in a subprocess against a real SGLang on PYTHONPATH: load plugins, drive the hooked API.

SGLang's import chain needs a GPU stack in places. On CPU we add small pure-Python
dependencies (orjson, pybase64, triton, starlette, IPython, aiohttp, pillow, pyzmq) and
stub exactly one module: `torchvision.io` (sglang.srt.utils.common imports decode_jpeg
from it; PyPI's torchvision would pull a CUDA build of torch).
"""

import importlib.machinery
import json
import logging
import sys
import tempfile
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

load_plugins()  # discovers specgate through its sglang.srt.plugins entry point

from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams  # noqa: E402

with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
    json.dump({"1": {"candidate_steps": [0, 3]}}, f)
params = AdaptiveSpeculativeParams(initial_steps=3, cfg_path=f.name)
trace = json.loads(sys.argv[1])
steps = [params.get_steps_for_batch(b) for b in trace]
ema = [params.on_verify_complete([0] * 8, 8) for _ in range(50)]  # would lower steps without the hook
print("RESULT", json.dumps({"version": sglang.__version__, "steps": steps, "ema": ema}))
