"""The ``plain`` reader: the sequential worker a user writes first, with its outputs.

One object at a time, one connection: GET the whole object into memory
(botocore), ``pydicom.dcmread``, ``pixel_array``, the Modality LUT in NumPy
(``readers.naive_values``), float32, ``numpy.save`` into memory, PUT the ``.npy``
to the output bucket. It is what the ``corpus`` workload's target compares the
worker with (sink on, as users run it). An object pydicom cannot read is
counted (``failed``) and passed over, as a plain worker would log it and go on;
its time is not held against it.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from ingest.bench.readers import naive_values
from ingest.bench.workloads import S3Target, Workload

PLAIN_PREFIX = "plain/"  # its outputs' keys, apart from the worker's


class PlainReader:
    name = "plain"

    def __init__(self, target: S3Target) -> None:
        self._target = target
        self._client: Any = None

    def prepare(self, workload: Workload) -> None:
        self._client = self._target.client(pool=1)

    def _one(self, key: str) -> int:
        body = self._client.get_object(Bucket=self._target.source_bucket, Key=key)["Body"]
        try:
            data = body.read()
        finally:
            body.close()
        values = naive_values(io.BytesIO(data))
        del data
        npy = io.BytesIO()
        np.save(npy, values)
        npy.seek(0)
        self._client.put_object(
            Bucket=self._target.output_bucket, Key=f"{PLAIN_PREFIX}{key}.npy", Body=npy
        )
        return int(values.nbytes)

    def run(self, workload: Workload) -> dict[str, Any]:
        written, puts, failed = 0, 0, []
        for obj in workload.objects:
            try:
                written += self._one(obj.key)
                puts += 1
            except Exception as exc:  # pydicom's, the decoders': a plain worker goes on
                failed.append(f"{obj.key}: {type(exc).__name__}: {exc}"[:200])
        return {"output_bytes": written, "outputs_put": puts, "failed": failed}

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
