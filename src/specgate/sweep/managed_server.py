"""Start a server for a benchmark and make sure it never outlives its parent.

The server runs in its own process group. `ManagedServer` waits for /health_generate,
and on return, exception, SIGINT or SIGTERM kills the whole group (SIGTERM, then SIGKILL
after a grace period). If the parent dies without cleaning up (SIGKILL), two things
still stop the server: the kernel sends the server SIGKILL (PR_SET_PDEATHSIG), and a
watchdog process in the server's group kills the group, which covers the server's own
children (SGLang's scheduler and detokenizer processes).

A benchmark job whose own parent dies (Snakemake killed with SIGKILL) must not go on
measuring to an empty room: `exit_when_orphaned()` stops every server of this process
and exits within about a second of the parent's death.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from pathlib import Path

PR_SET_PDEATHSIG = 1

# Runs in the server's process group: when the parent is gone, kill the group.
_WATCHDOG = """
import os, signal, sys, time
parent, group = int(sys.argv[1]), int(sys.argv[2])
while True:
    try:
        os.kill(parent, 0)
    except ProcessLookupError:
        os.killpg(group, signal.SIGKILL)
    if os.getppid() == 1 and parent != 1:
        os.killpg(group, signal.SIGKILL)
    time.sleep(0.2)
"""


def free_port(max_port: int = 55535) -> int:
    """A free TCP port on 127.0.0.1, at most `max_port`: SGLang 0.5.15 also binds port + 10000."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port <= max_port:
            return port


def _die_with_parent() -> None:
    os.setpgid(0, 0)  # own process group, same session, so the watchdog can join it
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


_LIVE: set[ManagedServer] = set()  # started and not yet stopped, for exit_when_orphaned


def _owner_pid() -> int:
    """The nearest ancestor that runs Snakemake (a job may sit under a shell), else the parent."""
    pid = os.getppid()
    for _ in range(4):
        try:
            if b"snakemake" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
        if pid <= 1:
            break
    return os.getppid()


def exit_when_orphaned(poll_s: float = 0.5) -> threading.Thread:
    """Watch the process that started this one; when it is gone, kill this process's servers and exit.

    Signals cannot do this: a SIGKILLed Snakemake sends none, and the job is reparented to init.
    """
    owner, parent = _owner_pid(), os.getppid()

    def gone() -> bool:
        if os.getppid() != parent:  # reparented: the direct parent died
            return True
        try:
            os.kill(owner, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False

    def watch() -> None:
        while not gone():
            time.sleep(poll_s)
        print(f"specgate: parent process {owner} is gone; stopping {len(_LIVE)} server(s) and exiting",
              file=sys.__stderr__, flush=True)  # fmt: skip
        for server in list(_LIVE):
            server.kill_group(grace=2)
        os._exit(128 + signal.SIGTERM)

    thread = threading.Thread(target=watch, name="exit-when-orphaned", daemon=True)
    thread.start()
    return thread


class ServerFailed(RuntimeError):
    pass


class ManagedServer:
    """`with ManagedServer(cmd, port, log) as server:` ... server.url ... (stopped on exit)."""

    def __init__(self, cmd: list[str], port: int, log_path: str | Path, *, ready_timeout: float = 600,
                 grace: float = 10, env: dict | None = None, host: str = "127.0.0.1"):  # fmt: skip
        self.cmd, self.port, self.log_path = cmd, port, Path(log_path)
        self.ready_timeout, self.grace, self.env = ready_timeout, grace, env
        self.url = f"http://{host}:{port}"
        self.proc: subprocess.Popen | None = None
        self.watchdog: subprocess.Popen | None = None
        self._old_handlers: dict = {}

    # -- start / stop ---------------------------------------------------------------

    def start(self) -> ManagedServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=self.env, preexec_fn=_die_with_parent)  # fmt: skip
        log.close()
        _LIVE.add(self)
        group = self.proc.pid  # the server leads its own process group
        self.watchdog = subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(group)],
                                         preexec_fn=lambda: os.setpgid(0, group), stdin=subprocess.DEVNULL)  # fmt: skip
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _on_signal(self, signum, frame):
        self.stop()
        raise SystemExit(128 + signum)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerFailed(f"server exited with code {self.proc.returncode} before it was ready\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health_generate", timeout=30) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        raise ServerFailed(f"server not ready after {self.ready_timeout:.0f} s\n{self.tail()}")

    def kill_group(self, grace: float) -> None:
        """SIGTERM to the server's process group, SIGKILL to whatever is left after `grace` seconds."""
        proc = self.proc
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left, the watchdog included
        proc.wait()

    def stop(self) -> None:
        if self.proc is None:
            return
        self.kill_group(self.grace)
        _LIVE.discard(self)
        if self.watchdog is not None:
            self.watchdog.wait()
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()
        self.proc = None

    def tail(self, lines: int = 50) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(deque(f, maxlen=lines))
        except OSError:
            return ""

    def __enter__(self) -> ManagedServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
