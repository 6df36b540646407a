"""Make SGLang importable on CPU for the plugin checks (imported first by each check script).

SGLang's import chain needs a GPU stack in places. On CPU we add small pure-Python
dependencies (orjson, pybase64, triton, starlette, IPython, aiohttp, pillow, pyzmq) and
stub exactly one module: `torchvision.io` (sglang.srt.utils.common imports decode_jpeg
from it; PyPI's torchvision would pull a CUDA build of torch).
"""

import importlib.machinery
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
