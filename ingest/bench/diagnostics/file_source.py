"""File sources on a GPU node: the worker over ``file://`` notifications, against KvikIO's
own read of the same files and against the worker over S3 notifications of the same bytes.

    python -m ingest.bench.diagnostics.file_source [--dir DIR] [--sizes-mib 1024,10240]
        [--ct 300] [--repeats 3] [--readers kvikio-file,ours-file-posix,...] [--out FILE]

Workloads, written once to ``DIR`` (default: a folder under the system's temporary one,
removed at the end unless ``--keep``) and uploaded to the embedded S3 server:
a CT series of ``--ct`` 512x512 16-bit slices, and one uncompressed object of each size
in ``--sizes-mib`` (512x512 16-bit frames; native up to 4 GiB, Encapsulated
Uncompressed with an Extended Offset Table past it, as a writer of such an object
must).

Readers, each a median of ``--repeats`` passes after a warm-up pass:

- ``kvikio-file`` (the ceiling): ``kvikio.CuFile(path).pread`` of every file into one
  device buffer, KvikIO's pool at ``--concurrency`` threads and 8 MiB tasks;
- ``ours-file-posix``, ``ours-file-kvikio``: the worker (sink off, a hook takes the
  arrays on the device: ``ours-hook``) over ``file://`` notifications, with
  ``FILE_READER=posix`` and ``kvikio``;
- ``ours-s3``: the same worker over S3 notifications of the same objects in the
  embedded SeaweedFS.

Reads after the first come from the page cache (the figures say ``cached``) unless
``--drop-caches`` is given and this process may write ``/proc/sys/vm/drop_caches``
(root); then the cache is dropped before every pass and the figures say ``cold``.
The JSON also says whether KvikIO ran GPUDirect Storage or its POSIX (compatibility)
mode: its ``compat_mode`` setting, whether the ``nvidia_fs`` module is loaded, and
the cuFile driver's properties where this KvikIO reports them.

Needs a CUDA device, CuPy and KvikIO for the KvikIO readers (others run without);
not a test (the file name keeps pytest away).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import anyio

from ingest.bench.gpu import configure_kvikio
from ingest.bench.measure import MiB
from ingest.bench.ours import HOOK_SPEC, OursRunner
from ingest.bench.workloads import FRAME_BYTES, BenchObject, S3Target, upload_file_multipart
from ingest.embedded.samples import synthetic_ct_series, synthetic_multiframe
from ingest.embedded.stack import Stack, create_topics, embedded_stack
from ingest.settings import Settings, load_settings

READERS = ("kvikio-file", "ours-file-posix", "ours-file-kvikio", "ours-s3")
NATIVE_LIMIT = 4 * 1024 * MiB - 2
ROOT_NAME = "bench"


def write_workloads(
    folder: Path, ct: int, sizes_mib: Sequence[int]
) -> dict[str, list[BenchObject]]:
    """The workloads' files under ``folder``; keys are their paths below it."""
    out: dict[str, list[BenchObject]] = {}
    if ct:
        series = []
        for name, data in synthetic_ct_series(ct):
            (folder / "ct" / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / "ct" / name).write_bytes(data)
            series.append(BenchObject(f"ct/{name}", len(data)))
        out[f"ct-{ct}"] = series
    (folder / "large").mkdir(parents=True, exist_ok=True)
    for size in sizes_mib:
        frames = max(1, size * MiB // FRAME_BYTES)
        encapsulated = frames * FRAME_BYTES > NATIVE_LIMIT
        key = f"large/{frames}x512x512{'-encapsulated' if encapsulated else ''}.dcm"
        path = synthetic_multiframe(
            frames, 512, 512, encapsulated="extended" if encapsulated else None, path=folder / key
        )
        out[f"large-{size}MiB"] = [BenchObject(key, path.stat().st_size)]
    return out


def upload(target: S3Target, folder: Path, objects: Sequence[BenchObject]) -> None:
    client = target.client()
    try:
        for obj in objects:
            upload_file_multipart(client, target.source_bucket, obj.key, folder / obj.key)
    finally:
        client.close()


def drop_caches(wanted: bool) -> bool:
    """Drop the page cache (root only); whether it was dropped."""
    if not wanted:
        return False
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def gds_status() -> dict[str, Any]:
    """Whether KvikIO may use GPUDirect Storage here, as far as this machine tells."""
    status: dict[str, Any] = {}
    try:
        modules = Path("/proc/modules").read_text()
        status["nvidia_fs_loaded"] = any(
            line.startswith("nvidia_fs ") for line in modules.splitlines()
        )
    except OSError:
        status["nvidia_fs_loaded"] = None
    try:
        import kvikio
        import kvikio.defaults

        status["kvikio"] = kvikio.__version__
        status["compat_mode"] = str(kvikio.defaults.get("compat_mode"))
    except Exception as exc:  # not installed, or a wheel that does not match the CUDA install
        status["kvikio"] = f"unavailable: {type(exc).__name__}: {exc}"
        return status
    try:
        from kvikio import cufile_driver

        status["cufile_driver"] = {
            name: str(cufile_driver.get(name))
            for name in ("is_gds_available", "major_version", "minor_version", "allow_compat_mode")
        }
    except Exception as exc:  # older KvikIO: other names, informative only
        status["cufile_driver"] = f"not reported ({type(exc).__name__})"
    return status


def kvikio_read(
    folder: Path, objects: Sequence[BenchObject], threads: int, repeats: int, cold: bool
) -> dict[str, Any]:
    """KvikIO's own read of the files into one device buffer: GB/s per pass."""
    import cupy
    import kvikio

    settings = configure_kvikio(8 * MiB, threads)
    total = sum(o.size for o in objects)
    device = cupy.empty(max(o.size for o in objects) * min(len(objects), 64), dtype=cupy.uint8)
    runs = []
    for index in range(repeats + 1):
        dropped = drop_caches(cold)
        start = time.perf_counter()
        futures: list[tuple[Any, Any]] = []
        for n, obj in enumerate(objects):
            slot = n % 64  # at most 64 files in flight, each in its own part of the buffer
            if len(futures) >= 64:
                handle, future = futures.pop(0)
                future.get()
                handle.close()
            handle = kvikio.CuFile(folder / obj.key, "r")
            view = device[slot * max(o.size for o in objects) :][: obj.size]
            futures.append((handle, handle.pread(view, obj.size, 0)))
        for handle, future in futures:
            future.get()
            handle.close()
        seconds = time.perf_counter() - start
        if index:  # the first pass warms up
            runs.append({"gb_per_s": total / seconds / 1e9, "seconds": seconds, "cold": dropped})
    return _summary(runs, total, len(objects)) | {"kvikio": settings}


def worker_settings(
    stack: Stack, target: S3Target, token: str, label: str, folder: Path, reader: str
) -> Settings:
    env = {
        "DICOM_INGEST_KAFKA_BOOTSTRAP": stack.kafka.bootstrap,
        "DICOM_INGEST_S3_ENDPOINT_URL": target.endpoint_url,
        "DICOM_INGEST_OUTPUT_URL": f"s3://{target.output_bucket}/out/",
        "DICOM_INGEST_AUDIT_KEY": base64.b64encode(os.urandom(32)).decode(),
        "DICOM_INGEST_SOURCE_TOPIC": f"files-{token}-{label}-events",
        "DICOM_INGEST_RESULTS_TOPIC": f"files-{token}-results",
        "DICOM_INGEST_DLQ_TOPIC": f"files-{token}-dlq",
        "DICOM_INGEST_AUDIT_TOPIC": f"files-{token}-audit",
        "DICOM_INGEST_GROUP_ID": f"files-{token}-{label}",
        "DICOM_INGEST_SESSION_TIMEOUT_MS": "2000",
        "DICOM_INGEST_HEARTBEAT_INTERVAL_MS": "200",
        "DICOM_INGEST_SINK": "none",
        "DICOM_INGEST_HOOK": HOOK_SPEC,
        "DICOM_INGEST_FILE_ROOTS": f"{ROOT_NAME}={folder}",
        "DICOM_INGEST_FILE_READER": reader,
    }
    return load_settings(env)


async def ours(
    stack: Stack,
    target: S3Target,
    folder: Path,
    label: str,
    objects: Sequence[BenchObject],
    reader: str,
    files: bool,
    repeats: int,
    cold: bool,
) -> dict[str, Any]:
    """The worker over one workload: file notifications (``files``) or S3 ones."""
    token = uuid.uuid4().hex[:8]
    settings = worker_settings(stack, target, token, label, folder, reader)
    await anyio.to_thread.run_sync(create_topics, stack.kafka.bootstrap, [settings.source_topic])
    notify: Callable[[BenchObject], bytes] | None = None
    if files:

        def notify(obj: BenchObject) -> bytes:
            url = "file://" + quote(str(folder / obj.key))
            return json.dumps({"url": url, "size": obj.size}).encode()

    runner = OursRunner(settings, target.source_bucket, [], notify)
    dropped = drop_caches(cold)
    result = await runner.measure(objects, objects[:1], repeats, None)
    result["cold_before_first_pass"] = dropped
    result["file_reader"] = reader if files else None
    result["backend"] = runner.worker.backend
    return result


def _summary(runs: list[dict[str, Any]], total: int, count: int) -> dict[str, Any]:
    return {
        "status": "ok",
        "runs": runs,
        "bytes": total,
        "objects": count,
        "median": {"gb_per_s": statistics.median(r["gb_per_s"] for r in runs)},
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    folder = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="dicom-ingest-files-"))
    report: dict[str, Any] = {"gds": gds_status(), "dir": str(folder), "workloads": {}}
    workloads = write_workloads(folder, args.ct, args.sizes_mib)
    try:
        with embedded_stack() as stack:
            os.environ.update(stack.endpoints.environment())  # the workers' S3 credentials
            c = stack.endpoints.credentials
            token = uuid.uuid4().hex[:8]
            target = S3Target(
                stack.s3.endpoint_url,
                c.region,
                c.access_key,
                c.secret_key,
                f"files-{token}-src",
                f"files-{token}-out",
            )
            for bucket in (target.source_bucket, target.output_bucket):
                stack.s3.create_bucket(bucket)
            for name, objects in workloads.items():
                print(f"{name}: uploading to the embedded S3", file=sys.stderr)
                await anyio.to_thread.run_sync(upload, target, folder, objects)
                results: dict[str, Any] = {}
                for reader in args.readers:
                    print(f"{name}: {reader}", file=sys.stderr)
                    try:
                        results[reader] = await _one(
                            reader, stack, target, folder, name, objects, args
                        )
                    except Exception as exc:  # one reader's failure is a row, not the run's end
                        while isinstance(exc, ExceptionGroup) and len(exc.exceptions) == 1:
                            exc = exc.exceptions[0]
                        results[reader] = {"status": f"failed: {type(exc).__name__}: {exc}"}
                report["workloads"][name] = results
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(folder, ignore_errors=True)
    return report


async def _one(
    reader: str,
    stack: Stack,
    target: S3Target,
    folder: Path,
    name: str,
    objects: Sequence[BenchObject],
    args: argparse.Namespace,
) -> dict[str, Any]:
    if reader == "kvikio-file":
        return await anyio.to_thread.run_sync(
            kvikio_read, folder, objects, args.concurrency, args.repeats, args.drop_caches
        )
    files = reader.startswith("ours-file")
    file_reader = reader.removeprefix("ours-file-") if files else "posix"
    return await ours(
        stack,
        target,
        folder,
        f"{name}-{reader}",
        objects,
        file_reader,
        files,
        args.repeats,
        args.drop_caches,
    )


def table(report: dict[str, Any]) -> str:
    lines = ["| workload | reader | GB/s (median) | / kvikio-file |", "| --- | --- | ---: | ---: |"]
    for name, results in report["workloads"].items():
        ceiling = results.get("kvikio-file", {}).get("median", {}).get("gb_per_s")
        for reader, result in results.items():
            rate = result.get("median", {}).get("gb_per_s")
            if rate is None:
                lines.append(f"| {name} | {reader} | {result.get('status')} | |")
                continue
            ratio = f"{rate / ceiling:.2f}" if ceiling else ""
            lines.append(f"| {name} | {reader} | {rate:.2f} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", help="folder for the files (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    parser.add_argument(
        "--sizes-mib", type=lambda t: [int(v) for v in t.split(",") if v], default=[1024, 10240]
    )
    parser.add_argument("--ct", type=int, default=300, help="CT slices (0: none)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16, help="KvikIO's threads")
    parser.add_argument(
        "--readers", type=lambda t: [v for v in t.split(",") if v], default=list(READERS)
    )
    parser.add_argument("--drop-caches", action="store_true", help="cold reads (needs root)")
    parser.add_argument("--out", type=Path, default=Path("file-source.json"))
    args = parser.parse_args(argv)
    unknown = set(args.readers) - set(READERS)
    if unknown:
        parser.error(f"unknown readers {sorted(unknown)}; known: {', '.join(READERS)}")
    report = anyio.run(run, args, backend="asyncio")
    args.out.write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps(report["gds"], indent=2))
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
