"""Run in a subprocess against a real SGLang on PYTHONPATH: load plugins, drive the hooked API."""

import json
import sys
import tempfile

import cpu_stubs  # noqa: F401  (first: lets SGLang import on CPU)
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
