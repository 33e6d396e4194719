"""Outputs encrypted at rest: SSE-S3 and SSE-KMS headers on every PUT and multipart
create, checked on moto's S3 (which keeps what each request asked for)."""

from __future__ import annotations

import botocore.session
import numpy as np
import pytest

from ingest.fetch.s3 import S3Source
from ingest.settings import load_settings
from ingest.sink.output import OutputSink
from tests.moto_kms import CREDENTIALS, MotoServer

pytestmark = [pytest.mark.anyio, pytest.mark.integration]


@pytest.mark.parametrize("mode", ["AES256", "aws:kms"])
async def test_every_output_write_asks_for_server_side_encryption(
    moto: MotoServer, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    s3 = botocore.session.get_session().create_client(
        "s3", endpoint_url=moto.endpoint_url, region_name="us-east-1"
    )
    bucket = f"sse-{mode.replace(':', '-').lower()}"
    s3.create_bucket(Bucket=bucket)
    extra = {}
    if mode == "aws:kms":
        kms = botocore.session.get_session().create_client(
            "kms", endpoint_url=moto.endpoint_url, region_name="us-east-1"
        )
        extra["DICOM_INGEST_OUTPUT_SSE_KMS_KEY_ID"] = kms.create_key()["KeyMetadata"]["KeyId"]
    settings = load_settings(
        {
            "DICOM_INGEST_KAFKA_BOOTSTRAP": "127.0.0.1:1",
            "DICOM_INGEST_AUDIT_KEY": "A" * 43 + "=",
            "DICOM_INGEST_OUTPUT_URL": f"s3://{bucket}/out/",
            "DICOM_INGEST_OUTPUT_SSE": mode,
            "DICOM_INGEST_S3_ENDPOINT_URL": moto.endpoint_url,
            **extra,
        }
    )
    big = np.arange(3 * 1024 * 1024 * 2, dtype=np.float32).reshape(6, 1024, 1024)  # 24 MiB
    async with S3Source(settings) as source:
        sink = OutputSink(source, settings)
        await sink.put_json("out/doc.json", {"a": 1})
        async with sink.array("out/big.npy", big.shape, "float32") as writer:
            for frame in big:
                await writer.write(frame[None])
    for key in ("out/doc.json", "out/big.npy"):
        head = s3.head_object(Bucket=bucket, Key=key)
        assert head["ServerSideEncryption"] == mode, key
        if mode == "aws:kms":
            assert head["SSEKMSKeyId"].endswith(extra["DICOM_INGEST_OUTPUT_SSE_KMS_KEY_ID"])
    assert "-" in s3.head_object(Bucket=bucket, Key="out/big.npy")["ETag"]  # it was multipart
