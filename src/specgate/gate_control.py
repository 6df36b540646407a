"""Switching a running server's gate: the sweep's way to measure every gate on one server.

A speculative server started with a control file (`specgate serve --gate-control PATH`, or the
`control` key of SPECGATE_GATE in SGLang) looks at the file between decode steps. When it has
changed, the server reads `{"generation": n, "gate": {...}}` and from the next step decides with
that gate: `{"disable_at": T, "enable_at": E, "min_dwell_steps": D}` (disable_at null: always
speculate) or `{"auto": {...}}`, as in SPECGATE_GATE. Each distinct setting keeps its own gate
object, so a hysteresis gate's state and the auto gate's estimates carry over from one of its
blocks to the next, as on a server of its own. The generation it runs is reported with the gate's
counters (`control_generation`), which is how the sweep knows the switch has happened.

A bad file is logged once and ignored: the server keeps the gate it has.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from specgate.gate import make_gate

log = logging.getLogger(__name__)


class GateControl:
    def __init__(self, path: str | os.PathLike, gate):
        self.path = Path(path)
        self.generation = 0
        self.gates = {}  # settings (as canonical JSON) -> the gate that runs them
        self.gate = gate
        self._seen = None  # (inode, mtime_ns, size) of the file last read

    def poll(self):
        """The gate to decide with now: a new one if the file changed since the last call."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return self.gate
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)  # write_control replaces the file: a new inode each time
        if stamp == self._seen:
            return self.gate
        self._seen = stamp
        try:
            msg = json.loads(self.path.read_text())
            generation, settings = int(msg["generation"]), dict(msg["gate"])
            key = json.dumps(settings, sort_keys=True)
            gate = self.gates.get(key) or make_gate(settings)
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.error("specgate gate control %s: ignored (%s); the gate stays as it was", self.path, e)
            return self.gate
        self.gates[key] = self.gate = gate
        self.generation = generation
        log.info("specgate gate control: generation %d, gate %s", generation, settings)
        return gate


def write_control(path: str | os.PathLike, generation: int, settings: dict) -> None:
    """Replace the control file in one step, so a server never reads half of it."""
    path = Path(path)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"generation": generation, "gate": settings}))
    tmp.replace(path)
