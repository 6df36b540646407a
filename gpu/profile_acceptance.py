"""Where the offline acceptance stage's time goes on a GPU (issue 6: 190 ms per batched step at
batch 64 on an H200, 265 s for the stage). SmolLM2-135M's shape with random weights: per-step
cost does not depend on the weights. Prints ms per batched spec step (k = 3) at batch 64, then a
torch.profiler table of one step's CUDA and CPU time by op.
usage (repo root, GPU host): PYTHONPATH=src python3 gpu/profile_acceptance.py [BATCH] [PROMPT_LEN]
"""

import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specgate.drafter import Eagle3Drafter, drafter_config
from specgate.llama import LlamaRunner
from specgate.spec_decode import Request, SpecDecoder

batch = int(sys.argv[1]) if len(sys.argv) > 1 else 64
prompt_len = int(sys.argv[2]) if len(sys.argv) > 2 else 400
torch.manual_seed(0)
cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000,
                  tie_word_embeddings=True)  # fmt: skip
model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
aux_layers = [1, 14, 26]
drafter = Eagle3Drafter(drafter_config(cfg, 16384, aux_layers))
drafter.init_from_target(model, torch.arange(16384))
drafter = drafter.to("cuda", torch.bfloat16).eval()
decoder = SpecDecoder(LlamaRunner(model, aux_layers), drafter, slots=batch, max_len=prompt_len + 300)
# staggered prompt lengths, as real prompts are; ignore_eos keeps every row alive
reqs = [Request(i, torch.randint(0, 49152, (prompt_len - 3 * i,)).tolist(), 256, ignore_eos=True) for i in range(batch)]
t0 = time.perf_counter()
for r in reqs:
    decoder.prefill(r)
torch.cuda.synchronize()
print(f"prefill of {batch} prompts: {time.perf_counter() - t0:.2f} s", flush=True)


def timed(n, rows):
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        decoder.spec_step(rows, 3)
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t) / n


timed(3, reqs)  # warm-up
print(f"batch {batch}, contiguous slots: {timed(10, reqs):.1f} ms per spec step (k=3)", flush=True)
scattered = reqs[::2]  # every other slot: the case once requests finish unevenly
print(f"batch {len(scattered)}, scattered slots: {timed(10, scattered):.1f} ms per spec step", flush=True)
t = time.perf_counter()
decoder.target.forward(torch.zeros(batch, 4, dtype=torch.long, device="cuda"), decoder.target_cache,
                       torch.arange(batch))  # fmt: skip
torch.cuda.synchronize()
print(f"one target forward of 4 tokens x {batch}: {1e3 * (time.perf_counter() - t):.1f} ms", flush=True)

from torch.profiler import ProfilerActivity, profile  # noqa: E402

with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    decoder.spec_step(scattered, 3)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15), flush=True)
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15), flush=True)
