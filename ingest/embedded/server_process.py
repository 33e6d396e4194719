"""A server as a loopback subprocess: started on free ports, waited for, stopped.

``ServerProcess`` is what ``ingest/embedded/stack.py``'s SeaweedFS and Tansu have in
common: each runs in its own session/process group, logs to a file (never to
a pipe that could fill up), is retried on new ports when a port was lost to a
race at start-up, and is stopped with SIGTERM, then SIGKILL, on the whole
group. An ``atexit`` hook kills what a crashed caller left running.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import ClassVar

from ingest.errors import IngestError

READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
_START_ATTEMPTS = 3
_PORT_TAKEN = re.compile(r"address (already )?in use|addrinuse|is not available", re.IGNORECASE)


class StackError(IngestError):
    """An embedded server failed to start or to answer; the message has its log tail."""

    reason = "stack"


def free_ports(count: int, grpc: bool = False) -> list[int]:
    """Ports free on 127.0.0.1 now (with p+10000 free too when ``grpc``); racy by nature."""
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            sock = socket.socket()
            held.append(sock)
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
            if grpc:
                if port + 10000 > 65535:
                    continue
                twin = socket.socket()
                held.append(twin)
                try:
                    twin.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            ports.append(port)
    finally:
        for sock in held:
            sock.close()
    return ports


_LIVE: set[ServerProcess] = set()


@atexit.register
def _kill_leftovers() -> None:
    for server in list(_LIVE):
        server._signal(signal.SIGKILL)


class ServerProcess:
    """One server process in its own process group, logging to a file in ``directory``."""

    name: ClassVar[str]

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.log = directory / f"{self.name.lower()}.log"
        self._popen: subprocess.Popen[bytes] | None = None
        self._log_from = 0

    def _command(self, new_ports: bool) -> tuple[list[str], dict[str, str]]:
        raise NotImplementedError

    def _answers(self) -> bool:
        raise NotImplementedError

    @property
    def pid(self) -> int:
        assert self._popen is not None, "never started"
        return self._popen.pid

    def _start(self, new_ports: bool = True) -> None:
        """Launch and wait until ready; retry on new ports when one was lost to a race.

        Raises:
            StackError: the server exited or did not answer within ``READY_TIMEOUT_S``.
        """
        for attempt in range(1, _START_ATTEMPTS + 1):
            argv, env = self._command(new_ports)
            with self.log.open("ab") as out:  # the child keeps its own copy of the descriptor
                self._log_from = out.tell()
                self._popen = subprocess.Popen(
                    argv,
                    cwd=self.directory,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            _LIVE.add(self)
            try:
                self._wait_ready()
                return
            except BaseException as exc:
                self.kill()
                lost_port = isinstance(exc, StackError) and _PORT_TAKEN.search(self._log_tail())
                if not (new_ports and lost_port and attempt < _START_ATTEMPTS):
                    raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if not self._alive():
                problem = "exited during start-up"
            elif self._answers():
                return
            elif time.monotonic() > deadline:
                problem = f"not ready in {READY_TIMEOUT_S:.0f}s"
            else:
                time.sleep(0.05)
                continue
            raise StackError(f"{self.name} {problem}; log {self.log}:\n{self._log_tail()}")

    def _alive(self) -> bool:
        """Whether the leader runs; never reaps it, so its group id cannot be reused meanwhile."""
        if self._popen is None or self._popen.returncode is not None:
            return False
        try:
            flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
            return os.waitid(os.P_PID, self._popen.pid, flags) is None
        except ChildProcessError:
            return False

    def _signal(self, signum: int) -> None:
        if self._popen is not None and self._popen.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._popen.pid, signum)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM the process group, SIGKILL it after ``timeout``, reap; idempotent."""
        if self._popen is None or self._popen.returncode is not None:
            return
        self._signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while self._alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        self._signal(signal.SIGKILL)  # stragglers in the group too, while its id is still ours
        self._popen.wait()
        _LIVE.discard(self)

    def kill(self) -> None:
        """SIGKILL the process group at once, as a crash would; idempotent."""
        self.stop(timeout=0)

    def _log_tail(self, size: int = 3000) -> str:
        try:
            with self.log.open("rb") as log:
                log.seek(max(self._log_from, log.seek(0, os.SEEK_END) - size))
                text = log.read().decode(errors="replace")
        except OSError:
            return "(no log)"
        return re.sub(r"\x1b\[[0-9;]*m", "", text)
