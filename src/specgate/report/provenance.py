"""Where a result came from: code version, config hash, packages and hardware."""

from __future__ import annotations

import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from specgate.files import stable_hash

PACKAGES = ("specgate", "torch", "transformers", "accelerate", "datasets", "safetensors", "snakemake", "sglang", "pandas")


def git_state(repo: str | Path) -> dict:
    def git(*args):
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (subprocess.CalledProcessError, FileNotFoundError):
        return {"commit": None, "dirty": None}


def package_versions() -> dict:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware() -> dict:
    import os

    import torch

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "gpus": gpus, "python": platform.python_version()}


def provenance(repo: str | Path, config: dict) -> dict:
    return {**git_state(repo), "repo": str(Path(repo).resolve()), "config_hash": stable_hash(config),
            "packages": package_versions(), **hardware()}  # fmt: skip
