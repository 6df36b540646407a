# Source on the GPU host (repo root) before anything that imports the carried SGLang wheels.
# Same as shared/gpu-sglang/env.sh, with specgate's source tree first (the entry point comes
# from the specgate wheel installed into /tmp/site).
export PYTHONPATH=$PWD/src:/tmp/site
export TVM_FFI_CACHE_DIR=/tmp/jitcache TRITON_CACHE_DIR=/tmp/tritoncache
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
