"""The gate's log inside SGLang processes."""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("specgate.gate")


def say(level: int, msg: str) -> None:
    """Log, and also write to stderr: SGLang loads plugins before it configures logging."""
    log.log(level, msg)
    if not logging.getLogger().handlers:
        print(f"[specgate] {msg}", file=sys.stderr, flush=True)
