"""How many mutated headers the direct reader takes, and whether each reads as pydicom reads it.

A diagnostic, not a test (pytest does not collect it)::

    .venv/bin/python -m ingest.bench.diagnostics.header_mutants [COUNT]

It draws COUNT (3,000) mutants of the CT and implicit-VR headers that
``tests/test_dicom_direct.py`` mutates, reads each with the direct reader and
with pydicom alone, fails on any header that differs, and prints how many the
direct reader took and how many it left to pydicom (and what pydicom made of
those).
"""

from __future__ import annotations

import collections
import sys

from hypothesis import HealthCheck, Phase, given, settings

from ingest.dicom.direct import read_plain_header
from tests.test_dicom_direct import LIMIT, mutated_headers, read


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    seen: collections.Counter[str] = collections.Counter()

    @settings(
        max_examples=count, deadline=None, database=None, derandomize=True,
        phases=[Phase.generate], suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    @given(mutated_headers())
    def check(data: bytes) -> None:
        plain = read_plain_header(data, len(data), LIMIT)
        slow = read(data, False)
        if plain is None:
            seen[
                "left to pydicom, which gave "
                + (slow[0] if isinstance(slow, tuple) else "a header")
            ] += 1
        else:
            assert plain == slow, (plain, slow)
            seen["read directly, as pydicom reads it"] += 1

    check()
    for what, n in seen.most_common():
        print(f"{n:6d}  {what}")


if __name__ == "__main__":
    main()
