"""What a worker process's resident memory is made of at its peak, sampled from outside.

A diagnostic, not a test (pytest does not collect it)::

    python3 -m ingest.bench.diagnostics.memory_watch OUT.json -- COMMAND ...

It runs ``COMMAND`` (typically ``python3 -m ingest.cli bench ... --scaled-modes
ours``) and, every 50 ms, reads the resident set of each process under it
whose command line has ``--parent-pid`` (a supervised worker). Whenever one
reaches a new peak it reads the process's ``smaps`` and keeps the breakdown:

- ``pinned``: ``/dev/zero`` shared mappings (``cuMemHostAlloc``: the ring,
  the output staging);
- ``cuda_driver``: ``/dev/nvidia*`` mappings (the driver's own host memory);
- ``heap``: ``[heap]`` (glibc's main arena);
- ``anon_large`` / ``anon_small``: other anonymous mappings of 4 MiB or more
  (NumPy arrays, glibc's thread arenas, mmapped allocations) and smaller
  ones (stacks, Python's small-object arenas);
- ``files``: shared libraries and other files.

It prints, per worker, the breakdown at start (first sample), at the peak
and at the last once-a-second look before it exited, in MiB, and the largest
mappings at the peak, and writes them to ``OUT.json``. A worker's own child
processes (the pool that decodes compressed frames) are part of its memory:
``tree_peak`` is the highest sum of the worker's and their resident sets seen
in one sample, and ``children_at_tree_peak`` their share of it; ``tree_pss_peak``
the same sum of proportional set sizes (``smaps_rollup``), which counts a page
that several of them map (NumPy's and pydicom's libraries) once, not once each.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ingest.bench.measure import pid_status_kib, process_tree

MiB = 1024 * 1024
LARGE_MIB = 4.0
INTERVAL_S = 0.05


def is_worker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"--parent-pid" in f.read()
    except OSError:
        return False


def pss_bytes(pid: int) -> int:
    """The proportional set size of ``pid`` (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def category(name: str, mapped_mib: float) -> str:
    if name == "/dev/zero" or name.startswith("/dev/zero "):
        return "pinned"
    if name.startswith("/dev/nvidia"):
        return "cuda_driver"
    if name == "[heap]":
        return "heap"
    if name in ("", "[anon]") or name.startswith("[anon:"):
        return "anon_large" if mapped_mib >= LARGE_MIB else "anon_small"
    if name.startswith("["):
        return "anon_small"  # [stack], [vdso], ...
    return "files"


def mappings(pid: int) -> list[tuple[float, float, str]]:
    """(resident MiB, mapped MiB, name) of each mapping in ``/proc/PID/smaps``."""
    out: list[tuple[float, float, str]] = []
    name, size = "", 0
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                first = line.split(maxsplit=1)[0]
                if "-" in first and not first.endswith(":"):
                    parts = line.split(maxsplit=5)
                    start, end = (int(x, 16) for x in first.split("-"))
                    name = parts[5].strip() if len(parts) > 5 else ""
                    size = end - start
                elif first == "Rss:":
                    out.append((int(line.split()[1]) / 1024, size / MiB, name))
    except OSError:
        return []
    return out


def breakdown(maps: list[tuple[float, float, str]]) -> dict[str, float]:
    """Resident MiB by category (see the module docstring), and ``total``."""
    out: dict[str, float] = {}
    for resident, size, name in maps:
        kind = category(name, size)
        out[kind] = out.get(kind, 0.0) + resident
    if out:
        out["total"] = sum(out.values())
    return {k: round(v, 1) for k, v in sorted(out.items())}


def largest(maps: list[tuple[float, float, str]], count: int = 12) -> list[list[object]]:
    """The ``count`` mappings holding the most: [resident MiB, mapped MiB, name]."""
    return [[round(r, 1), round(m, 1), n or "[anon]"] for r, m, n in sorted(maps)[-count:][::-1]]


@dataclass
class Watch:
    start: dict[str, float]
    peak_bytes: int = 0
    peak: dict[str, float] = field(default_factory=dict)
    peak_at: float = 0.0
    end: dict[str, float] = field(default_factory=dict)
    largest_at_peak: list[list[object]] = field(default_factory=list)
    tree_peak_bytes: int = 0
    children_at_tree_peak_bytes: int = 0
    tree_pss_peak_bytes: int = 0


def main() -> None:
    out_path = Path(sys.argv[1])
    command = sys.argv[sys.argv.index("--") + 1 :]
    watched: dict[int, Watch] = {}
    process = subprocess.Popen(command)
    samples = 0
    try:
        while process.poll() is None:
            samples += 1
            for pid in process_tree(process.pid):
                if pid not in watched and not is_worker(pid):
                    continue
                now = pid_status_kib(pid, "VmRSS") * 1024
                if not now:
                    continue
                w = watched.setdefault(pid, Watch(start=breakdown(mappings(pid))))
                if now > w.peak_bytes + MiB:
                    maps = mappings(pid)
                    w.peak_bytes, w.peak, w.peak_at = now, breakdown(maps), time.time()
                    w.largest_at_peak = largest(maps)
                children = sum(
                    pid_status_kib(child, "VmRSS") * 1024
                    for child in process_tree(pid)
                    if child != pid
                )
                if now + children > w.tree_peak_bytes:
                    w.tree_peak_bytes, w.children_at_tree_peak_bytes = now + children, children
                w.tree_pss_peak_bytes = max(
                    w.tree_pss_peak_bytes, sum(pss_bytes(p) for p in process_tree(pid))
                )
                if samples % 20 == 0:  # once a second: the last one seen is "end"
                    w.end = breakdown(mappings(pid))
            time.sleep(INTERVAL_S)
    finally:
        if process.poll() is None:
            process.terminate()
        process.wait()
    for pid, w in watched.items():
        print(f"worker {pid}: peak RSS {w.peak_bytes / MiB:.0f} MiB")
        print(
            f"  with its child processes: peak {w.tree_peak_bytes / MiB:.0f} MiB"
            f" (children {w.children_at_tree_peak_bytes / MiB:.0f} MiB then);"
            f" proportional set sizes: peak {w.tree_pss_peak_bytes / MiB:.0f} MiB"
        )
        print(f"  start {w.start}\n  peak  {w.peak}\n  end   {w.end}")
        print("  largest mappings at the peak (resident MiB, mapped MiB, name):")
        for row in w.largest_at_peak:
            print(f"    {row}")
    out_path.write_text(json.dumps({pid: asdict(w) for pid, w in watched.items()}, indent=1))
    sys.exit(process.returncode)


if __name__ == "__main__":
    main()
