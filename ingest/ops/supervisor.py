"""``dicom-ingest worker --processes N``: N worker processes in one consumer group.

One worker process is bound by its single asyncio thread (a few hundred small
objects per second), so a host scales out the way a cluster does: through the
Kafka consumer group. The parent starts N children, each the ordinary
``dicom-ingest worker`` (same ``--config`` file, same environment, so the same
``GROUP_ID``); the broker spreads the source topic's partitions over them. A
topic with fewer partitions than workers leaves the extra workers idle.

Child ``i`` (0-based) differs from its siblings only in:

- ``DICOM_INGEST_WORKER_ID`` = the parent's worker id + ``-i`` (the parent's is
  the configured one, else the host name): its own client id
  and its own audit hash chain;
- ``DICOM_INGEST_HEALTH_PORT`` = the configured port + ``i``, where one is set
  (the parent serves no health endpoint itself);
- ``CUDA_VISIBLE_DEVICES`` = ``GPUS[i mod len(GPUS)]`` with ``--gpus``;
- ``DICOM_INGEST_GPU_JPEG_DECODER`` = ``cuda`` where it is ``auto`` and more than one
  child shares a GPU (``shares_gpu``): their decoders then contend for the GPU's JPEG
  engines, and the CUDA decoder goes first.

Signals: SIGTERM/SIGINT are forwarded to every child; each drains within its
own ``SHUTDOWN_DEADLINE_S``, commits, leaves the group and exits 0, and the
parent exits 0 once all have. A child still running ``STOP_GRACE_S`` after
that deadline is SIGKILLed (its uncommitted offsets are redelivered) and the
parent exits 1.

Crashes: a child that exits non-zero or is killed while the parent is not
stopping is restarted after a capped exponential backoff (``RestartPolicy``),
and logged. Nothing is lost meanwhile: its uncommitted offsets go to the other
members at the group's next rebalance, or to the restarted child. A child that
exits 0 on its own (someone stopped it) is not restarted; one that exits 2 (a
configuration error) is not either: the parent stops the rest and exits 2.

Children are started with the hidden ``--parent-pid`` option: on Linux
they ask for SIGTERM when the parent dies (``PR_SET_PDEATHSIG``), so even a
SIGKILLed parent leaves no worker behind (each drains and exits); and they add
their worker id to every log line, since they share the parent's stderr.

``--processes auto`` chooses N for the host (``auto_processes``): one process without
a GPU (its decoding pool already uses every core), else one process for every
``CORES_PER_PROCESS`` cores, at most ``PROCESSES_PER_GPU`` a GPU, and no more than the
host's memory holds at one pinned ring and ``PROCESS_OVERHEAD_BYTES`` each.

The pure part (``child_specs``, ``child_environment``, ``shares_gpu``, ``auto_processes``,
``RestartPolicy``, ``classify_exit``) is apart from the process IO (``Supervisor``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Final

import anyio
import structlog
from anyio.abc import Process, TaskStatus

from ingest.errors import ConfigError
from ingest.settings import PREFIX, Settings

log = structlog.get_logger("dicom_ingest.supervisor")

STOP_GRACE_S = 30.0  # beyond a child's own drain deadline: closing clients, leaving the group
MAX_PROCESSES = 1024
CONFIG_EXIT = 2  # what ``dicom-ingest`` exits with on a configuration error
SPAWN_FAILED = 127  # the status we record when a child could not even be started
# A child stopped by our own signal before its handler was installed ends by the
# signal (or, for SIGINT, with the CLI's KeyboardInterrupt status): it had taken nothing.
CLEAN_STOP_EXITS = frozenset({0, 130, -signal.SIGTERM, -signal.SIGINT})


# ---------------------------------------------------------------------------------------
# Pure: what each child gets, when to restart


@dataclass(frozen=True, slots=True)
class ChildSpec:
    """Everything needed to (re)start child ``index``."""

    index: int
    worker_id: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(repr=False)
    gpu: str | None = None
    health_port: int | None = None


# A worker process keeps about two cores busy: its event loop, and its GET, device and
# decode-feeding threads between them.
CORES_PER_PROCESS: Final = 2
PROCESSES_PER_GPU: Final = 8  # more wait on one GPU's decoders and copy engines
# Besides its pinned ring: the CUDA driver, nvImageCodec's libraries, the decoding pool's
# share, Python, at most (docs/operations.md, "Processes per host")
PROCESS_OVERHEAD_BYTES: Final = 1 << 30


def auto_processes(cores: int, gpus: int, memory_bytes: int, ring_bytes: int) -> int:
    """The worker processes ``--processes auto`` starts on a host of ``cores`` usable cores,
    ``gpus`` visible GPUs (0 when the worker decodes on the CPU) and ``memory_bytes`` of
    memory, for workers of ``ring_bytes`` pinned ring each."""
    if gpus <= 0:
        return 1
    by_memory = memory_bytes // max(1, ring_bytes + PROCESS_OVERHEAD_BYTES)
    return max(
        1, min(cores // CORES_PER_PROCESS, PROCESSES_PER_GPU * gpus, by_memory, MAX_PROCESSES)
    )


def parse_gpus(text: str) -> tuple[str, ...]:
    """``"0,1"`` -> ``("0", "1")``; empty text means no assignment.

    Raises:
        ConfigError: an empty item (``"0,,1"``) or a blank one.
    """
    if not text.strip():
        return ()
    items = tuple(item.strip() for item in text.split(","))
    if any(not item for item in items):
        raise ConfigError(f"--gpus: expected a comma-separated list such as 0,1, got {text!r}")
    return items


def shares_gpu(processes: int, gpus: Sequence[str]) -> bool:
    """More than one of ``processes`` children uses one GPU: all of them use the visible
    ones without ``--gpus``, else child ``i`` uses ``gpus[i mod len(gpus)]``."""
    return processes > max(1, len(set(gpus)))


def child_environment(
    base: Mapping[str, str],
    index: int,
    worker_id: str,
    health_port: int,
    gpus: Sequence[str],
    jpeg_decoder: str | None = None,
) -> dict[str, str]:
    """The environment of child ``index``: ``base`` plus its worker id, health port, GPU
    and, where given, the JPEG decoder its GPU's sharing chose."""
    env = dict(base)
    env[f"{PREFIX}WORKER_ID"] = f"{worker_id}-{index}"
    if health_port:
        env[f"{PREFIX}HEALTH_PORT"] = str(health_port + index)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = gpus[index % len(gpus)]
    if jpeg_decoder:
        env[f"{PREFIX}GPU_JPEG_DECODER"] = jpeg_decoder
    return env


def worker_argv(
    config_file: Path | None, parent_pid: int, python: str = sys.executable
) -> tuple[str, ...]:
    """``python -m ingest.cli worker`` with the parent's ``--config``, as one supervised child."""
    argv = [python, "-m", "ingest.cli", "worker", "--parent-pid", str(parent_pid)]
    if config_file is not None:
        argv += ["--config", str(config_file)]
    return tuple(argv)


def child_specs(
    settings: Settings,
    processes: int,
    gpus: Sequence[str],
    base_env: Mapping[str, str],
    config_file: Path | None,
    parent_pid: int,
    python: str = sys.executable,
) -> list[ChildSpec]:
    """One ``ChildSpec`` per child, from the parent's validated settings.

    Raises:
        ConfigError: ``processes`` out of range, or health ports past 65535.
    """
    if not 1 <= processes <= MAX_PROCESSES:
        raise ConfigError(f"--processes: {processes} is outside [1, {MAX_PROCESSES}]")
    port = settings.health_port
    if port and port + processes - 1 > 65535:
        raise ConfigError(
            f"{PREFIX}HEALTH_PORT: {port} + {processes} processes passes 65535 (child i gets "
            "port + i)"
        )
    argv = worker_argv(config_file, parent_pid, python)
    shared = settings.gpu_jpeg_decoder == "auto" and shares_gpu(processes, gpus)
    jpeg = "cuda" if shared else None
    specs = []
    for index in range(processes):
        env = child_environment(base_env, index, settings.worker_id, port, gpus, jpeg)
        specs.append(
            ChildSpec(
                index=index,
                worker_id=env[f"{PREFIX}WORKER_ID"],
                argv=argv,
                env=env,
                gpu=gpus[index % len(gpus)] if gpus else None,
                health_port=port + index if port else None,
            )
        )
    return specs


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """Capped exponential backoff between restarts of one child.

    The n-th consecutive failure waits ``min(cap_s, first_s * 2**(n-1))``; a child
    that ran at least ``stable_s`` before failing starts the count again at 1.
    """

    first_s: float = 0.5
    cap_s: float = 30.0
    stable_s: float = 60.0

    def failures_after(self, previous: int, ran_s: float) -> int:
        return 1 if ran_s >= self.stable_s else previous + 1

    def delay_s(self, failures: int) -> float:
        if failures <= 0:
            return 0.0
        return min(self.cap_s, self.first_s * 2.0 ** min(failures - 1, 64))


class Exit(Enum):
    """What a child's exit means to the supervisor."""

    STOPPED = "stopped"  # stopped by us, cleanly
    FAILED_STOP = "failed_stop"  # stopped by us, but did not drain cleanly
    ENDED = "ended"  # exited 0 on its own: someone stopped it; not restarted
    CONFIG = "config"  # configuration error: restarting cannot help
    CRASHED = "crashed"  # restart it


def classify_exit(code: int, stopping: bool) -> Exit:
    """Classify an exit status (negative: killed by that signal)."""
    if stopping:
        return Exit.STOPPED if code in CLEAN_STOP_EXITS else Exit.FAILED_STOP
    if code == 0:
        return Exit.ENDED
    if code == CONFIG_EXIT:
        return Exit.CONFIG
    return Exit.CRASHED


def describe_exit(code: int) -> dict[str, Any]:
    """Log fields for an exit status: ``{"code": 1}`` or ``{"signal": "SIGKILL"}``."""
    if code < 0:
        try:
            return {"signal": signal.Signals(-code).name}
        except ValueError:
            return {"signal": -code}
    return {"code": code}


# ---------------------------------------------------------------------------------------
# Process IO


class Supervisor:
    """Keeps one process per ``ChildSpec`` running until ``stop()``; ``run()`` returns the status.

    Exit status of ``run()``: 0 when every child running at the stop drained
    and exited cleanly, 2 after a child's configuration error, 1 otherwise.
    """

    def __init__(
        self,
        specs: Sequence[ChildSpec],
        stop_timeout_s: float,
        policy: RestartPolicy | None = None,
    ) -> None:
        self._specs = list(specs)
        self._stop_timeout_s = stop_timeout_s
        self._policy = policy or RestartPolicy()
        self._stopping = anyio.Event()
        self._running: dict[int, Process] = {}
        self._failed_stop: set[int] = set()
        self._config_error = False
        self.restarts: dict[int, int] = {spec.index: 0 for spec in self._specs}

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def pids(self) -> dict[int, int]:
        """PID of each running child, by index."""
        return {index: process.pid for index, process in self._running.items()}

    def stop(self) -> None:
        """Forward SIGTERM to every running child; no child is started or restarted after."""
        self._stopping.set()
        for process in list(self._running.values()):
            _send(process, signal.SIGTERM)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> int:
        """Run the children until they have all ended; see the class for the status."""
        log.info("supervisor started", processes=len(self._specs))
        async with anyio.create_task_group() as outer:
            outer.start_soon(self._kill_stragglers)
            async with anyio.create_task_group() as children:
                for spec in self._specs:
                    children.start_soon(self._keep, spec)
                task_status.started()
            outer.cancel_scope.cancel()
        status = CONFIG_EXIT if self._config_error else (1 if self._failed_stop else 0)
        log.info("supervisor stopped", status=status, restarts=sum(self.restarts.values()))
        return status

    async def _keep(self, spec: ChildSpec) -> None:
        """Start the child; restart it with backoff after each crash, until stopping."""
        failures = 0
        while not self.stopping:
            started = anyio.current_time()
            code, pid = await self._run_once(spec)
            ran_s = anyio.current_time() - started
            verdict = classify_exit(code, self.stopping)
            fields = {
                "child": spec.index,
                "pid": pid,
                "worker": spec.worker_id,
                "ran_s": round(ran_s, 3),
                **describe_exit(code),
            }
            if verdict is Exit.STOPPED:
                log.info("child stopped", **fields)
                return
            if verdict is Exit.FAILED_STOP:
                self._failed_stop.add(spec.index)
                log.error("child did not stop cleanly", **fields)
                return
            if verdict is Exit.ENDED:
                log.warning("child exited on its own; not restarted", **fields)
                return
            if verdict is Exit.CONFIG:
                self._config_error = True
                log.error("child configuration error; stopping every child", **fields)
                self.stop()
                return
            failures = self._policy.failures_after(failures, ran_s)
            delay = self._policy.delay_s(failures)
            self.restarts[spec.index] += 1
            log.warning("child died; restarting", restart_in_s=delay, failures=failures, **fields)
            with anyio.move_on_after(delay):
                await self._stopping.wait()

    async def _run_once(self, spec: ChildSpec) -> tuple[int, int]:
        """Start the child and wait for it; (exit status, pid). Cancelled: it is killed.

        Raises:
            Nothing of its own: a failed spawn is reported as ``SPAWN_FAILED``.
        """
        try:
            process = await anyio.open_process(
                list(spec.argv), env=spec.env, stdin=subprocess.DEVNULL, stdout=None, stderr=None
            )
        except OSError as exc:  # e.g. out of processes: a crash like any other, retried
            log.exception("child could not start", child=spec.index, error=str(exc))
            return SPAWN_FAILED, 0
        async with process:  # on cancellation, aclose() kills it and waits
            self._running[spec.index] = process
            try:
                log.info(
                    "child started",
                    child=spec.index,
                    pid=process.pid,
                    worker=spec.worker_id,
                    gpu=spec.gpu,
                    health_port=spec.health_port,
                    restarts=self.restarts[spec.index],
                )
                if self.stopping:  # the stop came while it was being spawned
                    _send(process, signal.SIGTERM)
                code = await process.wait()
            finally:
                del self._running[spec.index]
        return code, process.pid

    async def _kill_stragglers(self) -> None:
        await self._stopping.wait()
        await anyio.sleep(self._stop_timeout_s)
        for index, process in list(self._running.items()):
            log.error("child did not stop in time; killing", child=index, pid=process.pid)
            _send(process, signal.SIGKILL)


def _send(process: Process, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signum)


async def run_supervisor(specs: Sequence[ChildSpec], shutdown_deadline_s: float) -> int:
    """The ``worker --processes N`` entry: supervise ``specs``; SIGTERM/SIGINT stop them.

    Returns the exit status (see ``Supervisor``).
    """
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        supervisor = Supervisor(specs, shutdown_deadline_s + STOP_GRACE_S)
        async with anyio.create_task_group() as group:

            async def on_signals() -> None:
                async for signum in signals:
                    name = signal.Signals(signum).name
                    log.info("signal received; stopping children", signal=name)
                    supervisor.stop()

            group.start_soon(on_signals)
            status = await supervisor.run()
            group.cancel_scope.cancel()
    return status


def die_with_parent(parent_pid: int) -> bool:
    """In a child: ask for SIGTERM when the parent dies (Linux); False if it is gone already.

    ``PR_SET_PDEATHSIG`` fires when the thread that forked us ends; the
    supervisor (and the bench) fork from their event loop thread, which lives as
    long as they do. A SIGTERM is the ordinary graceful stop: drain, commit, exit.
    """
    if sys.platform == "linux":
        pr_set_pdeathsig = 1
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    return os.getppid() == parent_pid
