"""Make SGLang importable on CPU for the plugin checks (imported first by each check script).

SGLang's import chain needs a GPU stack in places. On CPU we add small pure-Python
dependencies (orjson, pybase64, triton, starlette, IPython, aiohttp, pillow, pyzmq) and
stub one package: `torchvision` (SGLang's multimodal helpers import names from it at import
time; PyPI's torchvision would pull a CUDA build of torch). Every `torchvision.*` module is
served by a finder whose modules hand out a placeholder for any name; nothing in these checks
calls them. transformers is told there is no torchvision, so it does not use the stub.
"""

import importlib.abc
import importlib.machinery
import logging
import sys
import types

logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")


class _Placeholder:
    def __init__(self, name):
        self.__name__ = self.__qualname__ = name

    def __call__(self, *args, **kwargs):
        return None

    def __getattr__(self, name):
        return _Placeholder(f"{self.__name__}.{name}")

    def __mro_entries__(self, bases):  # usable as a base class
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self.__name__}.{name}")


class _TorchvisionStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _TorchvisionStub())

import transformers.utils  # noqa: E402
import transformers.utils.import_utils  # noqa: E402

for _module in (transformers.utils, transformers.utils.import_utils):
    _module.is_torchvision_available = lambda: False
    _module.is_torchvision_v2_available = lambda: False

# configs SGLang registers that this transformers already ships: SGLang's own take the name
from transformers import AutoConfig  # noqa: E402

_register = AutoConfig.register
AutoConfig.register = staticmethod(lambda model_type, config, exist_ok=False: _register(model_type, config, exist_ok=True))
