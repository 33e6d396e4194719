"""Slow PUTs against the embedded SeaweedFS, next to its volume roll-overs.

A diagnostic, not a test (pytest does not collect it)::

    python3 -m ingest.bench.diagnostics.put_stalls [EXTRA_WEED_FLAGS ...]

It starts SeaweedFS as the stack does (``ingest.embedded.stack``), with any extra
``weed mini`` flags appended (a flag given twice takes the last value, so
``-master.volumeSizeLimitMB=1024`` brings back ``mini``'s own volume size),
PUTs ``THREADS x PUTS`` objects of 1 MiB from as many threads, and prints the
slowest PUTs with the time each started, the moments the log says a volume
"becomes unwritable", and how many PUTs of 500 ms or more started from
1.5 s before to 0.2 s after such a moment. With 1 GiB volumes a roll-over
stalls the PUTs caught in it for about a second (``ingest.embedded.stack``'s
``VOLUME_FLAGS`` says why the stack uses larger ones).
"""

from __future__ import annotations

import datetime
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ingest.embedded import stack
from ingest.embedded.stack import _s3_client, start_seaweedfs

THREADS = 6
PUTS = 1500
SLOW_S = 0.5


def with_flags(extra: list[str]) -> None:
    """Append ``extra`` to the ``weed mini`` command line the stack builds."""
    build = stack.SeaweedFS._command

    def command(self: stack.SeaweedFS, new_ports: bool) -> tuple[list[str], dict[str, str]]:
        argv, env = build(self, new_ports)
        return [*argv, *extra], env

    stack.SeaweedFS._command = command  # type: ignore[method-assign]


def roll_overs(log: Path) -> list[float]:
    """Epoch seconds of each "Volume N becomes unwritable" line (glog: ``I1122 00:15:52.2``)."""
    today = datetime.date.today()
    out = []
    for line in log.read_text(errors="replace").splitlines():
        m = re.match(r"[IWE](\d\d)(\d\d) (\d\d):(\d\d):(\d\d\.\d+) .*becomes unwritable", line)
        if m:
            month, day, hh, mm, ss = m.groups()
            start = datetime.datetime(today.year, int(month), int(day), int(hh), int(mm))
            out.append(start.timestamp() + float(ss))
    return out


def main() -> None:
    with_flags(sys.argv[1:])
    body = os.urandom(1 << 20)
    puts: list[tuple[float, float]] = []  # (seconds, started at)
    with tempfile.TemporaryDirectory() as work, start_seaweedfs(Path(work)) as s3:
        s3.create_bucket("out")

        def put_many(thread: int) -> None:
            client: Any = _s3_client(s3.endpoint_url, s3.credentials)
            for i in range(PUTS):
                t0 = time.time()
                client.put_object(Bucket="out", Key=f"{thread}/{i}", Body=body)
                puts.append((time.time() - t0, t0))

        threads = [threading.Thread(target=put_many, args=(t,)) for t in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rolls = roll_overs(s3.directory / "weed.INFO")

    def clock(t: float) -> str:
        return datetime.datetime.fromtimestamp(t).strftime("%H:%M:%S.%f")[:-3]

    seconds = sorted(s for s, _ in puts)
    print(f"weed flags added: {' '.join(sys.argv[1:]) or '(none)'}")
    p50, p99 = seconds[len(seconds) // 2], seconds[int(len(seconds) * 0.99)]
    print(
        f"{len(puts)} PUTs of 1 MiB from {THREADS} threads: p50 {p50 * 1e3:.1f} ms, "
        f"p99 {p99 * 1e3:.1f} ms, max {seconds[-1] * 1e3:.0f} ms"
    )
    print("slowest:", ", ".join(f"{s * 1e3:.0f} ms at {clock(t)}" for s, t in sorted(puts)[-8:]))
    print("volumes becoming unwritable:", ", ".join(clock(t) for t in rolls) or "none")
    slow = [(s, t) for s, t in puts if s >= SLOW_S]
    near = [(s, t) for s, t in slow if any(-0.2 <= r - t <= 1.5 for r in rolls)]
    print(
        f"PUTs >= {SLOW_S * 1e3:.0f} ms: {len(slow)}, of which {len(near)} "
        "started from 1.5 s before to 0.2 s after a volume became unwritable"
    )


if __name__ == "__main__":
    main()
