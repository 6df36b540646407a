"""Llama runner and KV cache, the EAGLE-3 drafter, the speculative decoder, chat helpers."""
