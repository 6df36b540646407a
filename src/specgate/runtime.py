"""Process-level settings that the hot loops depend on."""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import functools
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


@functools.cache
def _glibc():
    """glibc, loaded once (find_library runs ldconfig), or None off glibc."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def keep_freed_memory(mmap_above: int = 1 << 30) -> bool:
    """Stop glibc from returning freed blocks below `mmap_above` bytes to the OS.

    Training and serving allocate and free tensors of tens of MB every step. By default
    glibc serves those with fresh mmaps, so every step pays page faults on first touch:
    on a 2-core VM that made a TTT training step 2-3x slower. Raising the mmap and trim
    thresholds keeps the memory in the heap for reuse. Blocks of `mmap_above` bytes or more
    still get their own mmap, returned to the OS when freed. No-op off glibc.
    """
    libc = _glibc()
    if libc is None:
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, mmap_above) and libc.mallopt(_M_TRIM_THRESHOLD, 1 << 36)
    return bool(ok and libc.mallopt(_M_TOP_PAD, 1 << 28))


def release_freed_memory() -> bool:
    """Hand the free pages inside glibc's heap back to the OS (malloc_trim), keeping the heap itself.

    With keep_freed_memory, a loop whose tensor sizes change every step (training batches of varying
    length) grows the heap by fragments it never returns: a training process's resident memory rose
    to 8 GB for 0.4 GB of data. Trimming every few steps slows that growth for a few page faults per
    step. No-op off glibc."""
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0))


def inheritable_stream(stream):
    """The stream if it has a file descriptor a child can inherit, else None (the parent's fds)."""
    try:
        stream.fileno()
        return stream
    except (AttributeError, OSError, ValueError):
        return None


# Snakemake sets every one of these to a job's `threads` (snakemake/shell.py), and ranks inherit them.
THREAD_VARS = ("OMP_NUM_THREADS", "GOTO_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
               "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")  # fmt: skip
# A GPU process's host work (collate, copies to the GPU) gains nothing past a few threads, and idle
# ones spin. On a 32-core host with 2 H200s, synthetic SmolLM2-shaped training ran fastest at 4 threads
# per rank, for 1 and 2 ranks (benchmarks/dp_scaling.py, docs/benchmarks/data-parallel.md).
GPU_HOST_THREADS = 4


def rank_threads(num_processes: int, env, on_gpu: bool = False) -> int:
    """Each rank's share of the job's threads for host-side work (collate, shard writes).

    The job's threads are OMP_NUM_THREADS where set (Snakemake sets it to the rule's `threads`),
    else every core. Left whole to each rank, the ranks of one host oversubscribe it: on the x2
    host, 2-rank training ran at 1,355% CPU load against 150% for one process."""
    threads = int(env.get("OMP_NUM_THREADS") or os.cpu_count() or 1)
    share = max(1, threads // num_processes)
    return min(share, GPU_HOST_THREADS) if on_gpu else share


def rank_env(num_processes: int, env, on_gpu: bool) -> dict:
    """The environment for each rank: every thread variable set to the rank's share, not only OMP's
    (Snakemake's MKL_NUM_THREADS and the rest would otherwise give each rank all of the job's)."""
    threads = str(rank_threads(num_processes, env, on_gpu))
    return {**env, **{name: threads for name in THREAD_VARS}}


def limit_gpu_host_threads() -> None:
    """In a single GPU process: no more host threads than GPU_HOST_THREADS (see there)."""
    import torch

    torch.set_num_threads(min(torch.get_num_threads(), GPU_HOST_THREADS))


def run_data_parallel(module: str, fn, job: dict, num_processes: int | str, work_dir: Path) -> None:
    """Run fn(**job) here, or as `python -m module --job FILE` on several processes.

    One process per GPU goes through `accelerate launch --multi_gpu`; several CPU processes
    (gloo) through torch's own launcher, which accelerate's state objects read the same way.
    """
    import torch

    on_gpu = job.get("device") != "cpu" and torch.cuda.is_available()
    if num_processes == "auto":
        num_processes = torch.cuda.device_count() if on_gpu else 1
    if num_processes <= 1:
        fn(**job)
        return
    job_file = Path(work_dir) / f"{module.rsplit('.', 1)[-1]}.job.json"
    job_file.parent.mkdir(parents=True, exist_ok=True)
    job_file.write_text(json.dumps(job))
    if on_gpu:
        launcher = ["accelerate.commands.launch", "--num_processes", str(num_processes), "--multi_gpu"]
    else:
        launcher = ["torch.distributed.run", "--nproc_per_node", str(num_processes)]
    cmd = [sys.executable, "-m", *launcher, "-m", module, "--job", str(job_file)]
    env = rank_env(num_processes, dict(os.environ), on_gpu)
    print("launching:", " ".join(cmd), f"(OMP_NUM_THREADS={env['OMP_NUM_THREADS']})", flush=True)
    # the ranks write to this stage's log (stage_log redirects sys.stdout/err, not the process's fds)
    subprocess.run(cmd, check=True, env=env, stdout=inheritable_stream(sys.stdout), stderr=inheritable_stream(sys.stderr))
    job_file.unlink(missing_ok=True)


def worker_main(fn) -> None:
    """Entry point of a data-parallel worker: fn(**job) with the job read from --job FILE."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    import torch.distributed as dist

    try:
        fn(**json.loads(Path(args.job).read_text()))
    finally:
        if dist.is_initialized():  # NCCL warns of leaked resources otherwise
            dist.destroy_process_group()


def pick_device(device: str):
    """`auto` -> CUDA when present, else CPU."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def native_bf16(device) -> bool:
    """Whether bf16 matmuls run natively on `device`.

    A CPU without AVX512-BF16 or AMX runs them through conversions: on a 2-vCPU Xeon without either,
    a SmolLM2-sized bf16 matmul took 5.3x the fp32 one, and the whole workflow ran 3-6x slower in bf16."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def float_dtype(requested: str, device: str = "auto") -> str:
    """A dtype name, with `auto` resolved: bfloat16 where `device` runs it natively, else float32."""
    if requested != "auto":
        return requested
    return "bfloat16" if native_bf16(pick_device(device)) else "float32"
