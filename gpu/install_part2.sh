# Sourced by the second device call: install SGLang wheel part 2 (+ the patch) and gguf, then check the
# imports and that SGLang's own plugin loader finds specgate's entry point. Needs C (the carried folder).
bash $C/install.sh $C/part2
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/gg $C/part2/gguf-*.whl
source gpu/device_env.sh
python3 -c "import sglang, transformers, flashinfer, sgl_kernel, gguf, aiohttp, pandas; print('sglang', sglang.__version__, 'transformers', transformers.__version__, 'flashinfer', flashinfer.__version__, 'aiohttp', aiohttp.__version__, 'pandas', pandas.__version__)"
python3 - <<'PY'
import logging, importlib.metadata as md
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
print("entry points:", [(e.name, e.value, e.dist.name if e.dist else None) for e in md.entry_points(group="sglang.srt.plugins")])
from sglang.srt.plugins import load_plugins_by_group
print("SGLang's loader found:", load_plugins_by_group("sglang.srt.plugins"))
PY
