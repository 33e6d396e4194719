"""The benchmark's objects: a CT series, one large multi-frame object, and their mix;
the ``corpus`` (the mix plus the demo's samples of many kinds: pydicom's test files
and the compressed samples, what an archive holds); and the decode workloads
(``DECODE_WORKLOADS``, made in ``workloads_compressed``).

All are synthetic and deterministic (``ingest.embedded.samples``). The large object is
streamed to a temporary file frame by frame and uploaded with a multipart
upload, so neither step holds it in memory. Every reader reads the same
objects from the same bucket.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from pydicom.uid import HTJ2KLossless, JPEG2000Lossless, JPEGBaseline8Bit, RLELossless

from ingest.bench.measure import MiB
from ingest.embedded.samples import synthetic_ct_series, synthetic_multiframe

UPLOAD_PART = 64 * MiB
FRAME_BYTES = 512 * 512 * 2
FETCH_WORKLOADS = ("ct", "large", "mix")
CORPUS = "corpus"  # a fetch workload, run when named
# Compressed objects, decoded on the CPU: workload -> transfer syntax of its frames
DECODE_WORKLOADS = {
    "slide": JPEGBaseline8Bit,  # 256 x 256 tiles of a whole-slide image
    "slide-512": JPEGBaseline8Bit,  # 512 x 512 tiles of a whole-slide image
    "ct-j2k": JPEG2000Lossless,  # a CT series
    "ct-htj2k": HTJ2KLossless,  # a CT series
    "ct-rle": RLELossless,  # a CT series
    "ct-jpeg": JPEGBaseline8Bit,  # the CT series windowed to 8 bits: secondary captures
    "ct-htj2k-volume": HTJ2KLossless,  # the HTJ2K series as one Enhanced CT
    "ct-j2k-volume": JPEG2000Lossless,  # the JPEG 2000 series as one Enhanced CT
}


@dataclass(frozen=True, slots=True)
class S3Target:
    """Where the objects live and how to sign for them (path-style addressing)."""

    endpoint_url: str
    region: str
    access_key: str
    secret_key: str
    source_bucket: str
    output_bucket: str

    def url(self, key: str) -> str:
        return f"{self.endpoint_url.rstrip('/')}/{self.source_bucket}/{quote(key, safe='/-_.~')}"

    def client(self, pool: int = 32) -> Any:
        """A synchronous botocore S3 client (thread-safe) with ``pool`` connections."""
        import botocore.config
        import botocore.session

        return botocore.session.get_session().create_client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=self.region,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            config=botocore.config.Config(
                max_pool_connections=pool,
                retries={"max_attempts": 3},
                s3={"addressing_style": "path"},
                read_timeout=120,
            ),
        )


@dataclass(frozen=True, slots=True)
class BenchObject:
    key: str
    size: int


@dataclass(frozen=True, slots=True)
class Workload:
    """Objects in the source bucket; a decode workload also has local copies (``files``, in
    ``objects`` order) and the size of its frames as ``pixel_array`` returns them."""

    name: str
    objects: tuple[BenchObject, ...]
    frames: int = 0  # decode workloads: frames in all objects
    frame_bytes: int = 0  # decode workloads: bytes of one decoded frame (pixel_array's)
    files: tuple[Path, ...] = ()
    syntax: str = ""
    info: tuple[tuple[str, Any], ...] = ()  # what else describe() reports (a slide's grid)

    @property
    def bytes(self) -> int:
        return sum(o.size for o in self.objects)

    @property
    def decoded_bytes(self) -> int:
        return self.frames * self.frame_bytes

    def describe(self) -> dict[str, Any]:
        sizes = [o.size for o in self.objects]
        out: dict[str, Any] = {
            "objects": len(sizes),
            "bytes": sum(sizes),
            "min_object_bytes": min(sizes),
            "max_object_bytes": max(sizes),
        }
        if self.frames:
            out["transfer_syntax"], out["frames"] = self.syntax, self.frames
            out["frame_bytes"], out["decoded_bytes"] = self.frame_bytes, self.decoded_bytes
        return out | dict(self.info)


def ensure_buckets(target: S3Target) -> None:
    """Create the source and output buckets; ones we own already are fine.

    Raises:
        botocore.exceptions.ClientError: the server refused for another reason.
    """
    from botocore.exceptions import ClientError

    client = target.client()
    try:
        for bucket in (target.source_bucket, target.output_bucket):
            try:
                client.create_bucket(Bucket=bucket)
            except ClientError as exc:
                code = exc.response.get("Error", {}).get("Code")
                if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise
    finally:
        client.close()


def upload_file_multipart(client: Any, bucket: str, key: str, path: Path, threads: int = 4) -> int:
    """Upload ``path`` in ``UPLOAD_PART`` parts, ``threads`` at a time; returns its size.

    Raises:
        botocore.exceptions.ClientError: a part or the completion failed (the upload is aborted).
    """
    size = path.stat().st_size
    upload_id = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    fd = os.open(path, os.O_RDONLY)

    def part(number: int) -> dict[str, Any]:
        offset = (number - 1) * UPLOAD_PART
        body = os.pread(fd, min(UPLOAD_PART, size - offset), offset)
        resp = client.upload_part(
            Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body
        )
        return {"PartNumber": number, "ETag": resp["ETag"]}

    try:
        count = max(1, -(-size // UPLOAD_PART))
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            parts = list(pool.map(part, range(1, count + 1)))
        client.complete_multipart_upload(
            Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
        )
    except BaseException:
        with contextlib.suppress(Exception):
            client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
        raise
    finally:
        os.close(fd)
    return size


def prepare_workloads(
    target: S3Target,
    names: list[str],
    ct_count: int,
    large_mb: int,
    tmpdir: Path,
    progress: Callable[[str], None] = lambda _: None,
    large_syntax: str = "native",
    slide_mb: int = 200,
    decode_corpus: Path | None = None,
) -> dict[str, Workload]:
    """Generate and upload the objects the named workloads need; returns them by name,
    in ``names``' order.

    ``large_mb`` is in MiB of Pixel Data (512 x 512 16-bit frames, per-frame rescale),
    native or (``large_syntax="encapsulated"``) Encapsulated Uncompressed with an
    Extended Offset Table, as a writer of an object past 4 GiB would write it. The
    decode workloads (``DECODE_WORKLOADS``: ``ct_count`` slices a series, a slide of
    about ``slide_mb`` MiB) are written under ``tmpdir`` and kept there, or taken from
    ``decode_corpus`` (``workloads_compressed.write_corpus``).

    Raises:
        ValueError: a workload name not known, a native object past 4 GiB - 2 bytes of
            Pixel Data, or a CT series that can be neither encoded here nor found in
            ``decode_corpus``.
        botocore.exceptions.ClientError: an upload failed.
    """
    known_names = (*FETCH_WORKLOADS, CORPUS, *DECODE_WORKLOADS)
    unknown = [n for n in names if n not in known_names]
    if unknown:
        known = ", ".join(known_names)
        raise ValueError(f"unknown workload {', '.join(unknown)} (known: {known})")
    out = _fetch_workloads(target, names, ct_count, large_mb, tmpdir, progress, large_syntax)
    if set(names) & set(DECODE_WORKLOADS):
        from ingest.bench.workloads_compressed import prepare_decode_workloads

        out |= prepare_decode_workloads(
            target, names, ct_count, slide_mb, tmpdir, progress, decode_corpus
        )
    return {name: out[name] for name in names}


def _fetch_workloads(
    target: S3Target,
    names: list[str],
    ct_count: int,
    large_mb: int,
    tmpdir: Path,
    progress: Callable[[str], None],
    large_syntax: str,
) -> dict[str, Workload]:
    client = target.client()
    out: dict[str, Workload] = {}
    try:
        ct: list[BenchObject] = []
        if {"ct", "mix", CORPUS} & set(names):
            progress(f"generating and uploading {ct_count} CT slices")
            series = synthetic_ct_series(ct_count)

            def put(item: tuple[str, bytes]) -> BenchObject:
                key = f"bench/{item[0]}"
                client.put_object(Bucket=target.source_bucket, Key=key, Body=item[1])
                return BenchObject(key, len(item[1]))

            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                ct = list(pool.map(put, series))
            del series
        large: BenchObject | None = None
        if {"large", "mix", CORPUS} & set(names):
            frames = max(1, large_mb * MiB // FRAME_BYTES)
            encapsulated = large_syntax == "encapsulated"
            name = f"enhanced-ct-{frames}x512x512{'-encapsulated' if encapsulated else ''}.dcm"
            progress(f"writing the large object ({frames} frames) to a temporary file")
            path = synthetic_multiframe(
                frames,
                512,
                512,
                encapsulated="extended" if encapsulated else None,
                path=tmpdir / name,
            )
            progress(f"uploading the large object ({path.stat().st_size / 1e9:.2f} GB, multipart)")
            key = f"bench/large/{name}"
            try:
                large = BenchObject(
                    key, upload_file_multipart(client, target.source_bucket, key, path)
                )
            finally:
                path.unlink(missing_ok=True)
        for name in names:
            if name == "ct":
                out[name] = Workload("ct", tuple(ct))
            elif name == "large":
                assert large is not None
                out[name] = Workload("large", (large,))
            elif name == "mix":
                assert large is not None
                # The large object first, then the series: small objects queue behind it.
                out[name] = Workload("mix", (large, *ct))
            elif name == CORPUS:
                assert large is not None
                progress("uploading the samples of many kinds")
                samples = _upload_samples(client, target)
                out[name] = Workload(CORPUS, (large, *samples, *ct))
    finally:
        client.close()
    return out


def _upload_samples(client: Any, target: S3Target) -> list[BenchObject]:
    """pydicom's test files the worker processes and the compressed samples (the demo's)."""
    from ingest.embedded.samples import pydicom_examples
    from ingest.embedded.samples_compressed import compressed_samples

    out = []
    for name, data in [*pydicom_examples(dead_lettered=False), *compressed_samples()]:
        key = f"bench/samples/{name}"
        client.put_object(Bucket=target.source_bucket, Key=key, Body=data)
        out.append(BenchObject(key, len(data)))
    return out


def warmup_object(target: S3Target) -> BenchObject:
    """One small CT slice under its own key, to start a worker before it is measured.

    Raises:
        botocore.exceptions.ClientError: the upload failed.
    """
    key, data = synthetic_ct_series(1, seed=99)[0]
    client = target.client()
    try:
        client.put_object(Bucket=target.source_bucket, Key=f"bench/warmup/{key}", Body=data)
    finally:
        client.close()
    return BenchObject(f"bench/warmup/{key}", len(data))
