"""Crash-safe file writing, resumable shard directories and stage logging.

Every artifact is written to a temporary name in its final directory and renamed
into place, so a reader never sees half a file and a killed stage leaves either
the old artifact or nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TMP_MARK = ".tmp-"


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling of `path`; rename it onto `path` only on success.

    Works for files and directories. An existing target is replaced.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}{TMP_MARK}{uuid.uuid4().hex[:8]}")
    try:
        yield tmp
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()


def write_json(path: str | os.PathLike, obj: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    with open(path) as f:
        return json.load(f)


def write_jsonl(path: str | os.PathLike, records) -> int:
    n = 0
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            n += 1
    return n


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def canonical(obj: Any) -> Any:
    """`obj` with every dict's keys sorted, recursively: equal data, equal text."""
    if isinstance(obj, dict):
        return {k: canonical(obj[k]) for k in sorted(obj)}
    if isinstance(obj, (list, tuple)):
        return [canonical(v) for v in obj]
    return obj


def stable_hash(obj: Any) -> str:
    """Short hash of a JSON-serialisable value, independent of dict order."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


class ShardDir:
    """A directory of shards that a killed stage can resume.

    Shards are only ever renamed into place, so a shard that exists is complete.
    `fingerprint` identifies the inputs and settings that produced the shards: a
    directory made with another fingerprint is wiped instead of being reused.
    """

    def __init__(self, root: str | os.PathLike, fingerprint: str, *, reset: bool = True):
        self.root = Path(root)
        self.fingerprint = fingerprint
        stamp = self.root / "FINGERPRINT"
        if reset:
            if self.root.exists() and (not stamp.exists() or stamp.read_text().strip() != fingerprint):
                shutil.rmtree(self.root)
            self.root.mkdir(parents=True, exist_ok=True)
            for leftover in self.root.glob(f"*{TMP_MARK}*"):
                shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
            if not stamp.exists():
                with atomic_path(stamp) as tmp:
                    tmp.write_text(fingerprint + "\n")

    def path(self, name: str) -> Path:
        return self.root / name

    def done(self, name: str) -> bool:
        return (self.root / name).exists()


@contextlib.contextmanager
def stage_log(path: str | os.PathLike | None) -> Iterator[None]:
    """Send stdout, stderr (tqdm bars included) and logging of a stage to its log file."""
    if path is None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", force=True)
        yield
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", buffering=1) as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=f, force=True)
        try:
            yield
        except BaseException:
            import traceback

            traceback.print_exc(file=f)
            raise
        finally:
            logging.basicConfig(level=logging.INFO, stream=sys.__stderr__, force=True)
