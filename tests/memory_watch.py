"""What a worker process's resident memory is made of at its peak, sampled from outside.

A diagnostic, not a test (pytest does not collect it)::

    python3 -m tests.memory_watch OUT.json -- COMMAND ...

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
and at the last once-a-second look before it exited, in MiB, and writes them
to ``OUT.json``. docs/benchmarks.md (round 13) quotes it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

MiB = 1024 * 1024
LARGE = 4 * MiB
INTERVAL_S = 0.05


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def descendants(root: int) -> list[int]:
    out, todo = [], [root]
    while todo:
        for child in _children(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


def is_worker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"--parent-pid" in f.read()
    except OSError:
        return False


def rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def category(name: str, size: int) -> str:
    if name == "/dev/zero" or name.startswith("/dev/zero "):
        return "pinned"
    if name.startswith("/dev/nvidia"):
        return "cuda_driver"
    if name == "[heap]":
        return "heap"
    if name in ("", "[anon]") or name.startswith("[anon:"):
        return "anon_large" if size >= LARGE else "anon_small"
    if name.startswith("["):
        return "anon_small"  # [stack], [vdso], ...
    return "files"


def breakdown(pid: int) -> dict[str, float]:
    """Resident MiB by category (see the module docstring), and ``total``."""
    out: dict[str, float] = {}
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
                    kind = category(name, size)
                    out[kind] = out.get(kind, 0.0) + int(line.split()[1]) / 1024
    except OSError:
        return {}
    out["total"] = sum(out.values())
    return {k: round(v, 1) for k, v in sorted(out.items())}


@dataclass
class Watch:
    start: dict[str, float]
    peak_bytes: int = 0
    peak: dict[str, float] = field(default_factory=dict)
    peak_at: float = 0.0
    end: dict[str, float] = field(default_factory=dict)


def main() -> None:
    out_path = Path(sys.argv[1])
    command = sys.argv[sys.argv.index("--") + 1 :]
    watched: dict[int, Watch] = {}
    process = subprocess.Popen(command)
    samples = 0
    try:
        while process.poll() is None:
            samples += 1
            for pid in descendants(process.pid):
                if pid not in watched and not is_worker(pid):
                    continue
                now = rss(pid)
                if not now:
                    continue
                w = watched.setdefault(pid, Watch(start=breakdown(pid)))
                if now > w.peak_bytes + MiB:
                    w.peak_bytes, w.peak, w.peak_at = now, breakdown(pid), time.time()
                if samples % 20 == 0:  # once a second: the last one seen is "end"
                    w.end = breakdown(pid)
            time.sleep(INTERVAL_S)
    finally:
        if process.poll() is None:
            process.terminate()
        process.wait()
    for pid, w in watched.items():
        print(f"worker {pid}: peak RSS {w.peak_bytes / MiB:.0f} MiB")
        print(f"  start {w.start}\n  peak  {w.peak}\n  end   {w.end}")
    out_path.write_text(json.dumps({pid: asdict(w) for pid, w in watched.items()}, indent=1))
    sys.exit(process.returncode)


if __name__ == "__main__":
    main()
