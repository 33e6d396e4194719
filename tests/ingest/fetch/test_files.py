"""The file source: reads into slots, versions as ETags, refused paths, changed files."""

from __future__ import annotations

import base64
import errno
import importlib.util
import os
from pathlib import Path

import anyio
import pytest

from ingest.errors import (
    AccessDenied,
    ConfigError,
    ObjectChanged,
    ObjectNotFound,
    SourceError,
    SourceUnavailable,
)
from ingest.fetch.files import FileSource, file_etag, translate_file_error
from ingest.fetch.planning import ByteRange
from ingest.settings import Settings, load_settings

pytestmark = pytest.mark.anyio


def settings_for(roots: str, **extra: str) -> Settings:
    env = {
        "DICOM_INGEST_KAFKA_BOOTSTRAP": "127.0.0.1:9092",
        "DICOM_INGEST_OUTPUT_URL": "s3://out/",
        "DICOM_INGEST_AUDIT_KEY": base64.b64encode(bytes(32)).decode(),
        "DICOM_INGEST_FILE_ROOTS": roots,
        "DICOM_INGEST_FILE_READER": "posix",
        "DICOM_INGEST_MAX_ATTEMPTS": "2",
        "DICOM_INGEST_RETRY_MAX_WAIT_S": "0",
    }
    env.update({f"DICOM_INGEST_{k.upper()}": v for k, v in extra.items()})
    return load_settings(env)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """archive/ (the root) with a file, a sub-folder, links in and out, and a secret beside."""
    root = tmp_path / "archive"
    (root / "ct").mkdir(parents=True)
    (root / "ct" / "a.dcm").write_bytes(bytes(range(256)) * 40)  # 10,240 bytes
    (tmp_path / "secret.dcm").write_bytes(b"not yours")
    (root / "inside-link.dcm").symlink_to(root / "ct" / "a.dcm")
    (root / "outside-link.dcm").symlink_to(tmp_path / "secret.dcm")
    (root / "outside-dir").symlink_to(tmp_path)
    os.mkfifo(root / "pipe.dcm")
    return tmp_path


async def test_reads_the_whole_file_or_its_first_bytes_and_learns_its_version(tree: Path) -> None:
    data = (tree / "archive" / "ct" / "a.dcm").read_bytes()
    async with FileSource(settings_for(f"archive={tree / 'archive'}")) as files:
        where = await files.locate("archive", "ct/a.dcm", None)
        into = bytearray(16384)
        head, filled, parsed = await files.read_first_then(
            where, memoryview(into), lambda view: bytes(view)
        )
        assert (head.size, filled, parsed) == (len(data), len(data), data)
        assert head.etag == file_etag(os.stat(tree / "archive" / "ct" / "a.dcm"))
        small = bytearray(1000)  # a probe: the first bytes, and no ``then``
        head, filled, parsed = await files.read_first_then(
            where, memoryview(small), lambda view: bytes(view)
        )
        assert (filled, parsed, bytes(small)) == (1000, None, data[:1000])
        part = bytearray(4096)
        await files.read_into(where, head, ByteRange(5000, 9096), memoryview(part))
        assert bytes(part) == data[5000:9096]


async def test_a_link_inside_the_root_is_followed(tree: Path) -> None:
    data = (tree / "archive" / "ct" / "a.dcm").read_bytes()
    async with FileSource(settings_for(f"archive={tree / 'archive'}")) as files:
        where = await files.locate("archive", "inside-link.dcm", None)
        into = bytearray(len(data))
        _, filled, _ = await files.read_first_then(where, memoryview(into), None)
        assert bytes(into[:filled]) == data


@pytest.mark.parametrize(
    ("bucket", "key", "error"),
    [
        ("archive", "outside-link.dcm", AccessDenied),  # a link out of the root
        ("archive", "outside-dir/secret.dcm", AccessDenied),  # a folder link out of it
        ("archive", "../secret.dcm", AccessDenied),  # words that climb out
        ("archive", "ct/./a.dcm", AccessDenied),
        ("archive", "/etc/passwd", AccessDenied),  # an absolute key
        ("elsewhere", "ct/a.dcm", AccessDenied),  # no such root
        ("archive", "ct", SourceError),  # a folder
        ("archive", "pipe.dcm", SourceError),  # a FIFO: refused at once, never waited on
        ("archive", "ct/missing.dcm", ObjectNotFound),
    ],
)
async def test_refused_paths(tree: Path, bucket: str, key: str, error: type[Exception]) -> None:
    async with FileSource(settings_for(f"archive={tree / 'archive'}")) as files:

        async def read() -> None:
            where = await files.locate(bucket, key, None)
            await files.read_first_then(where, memoryview(bytearray(100)), None)

        with anyio.fail_after(5), pytest.raises(error) as raised:
            await read()
        assert str(tree) not in str(raised.value)  # paths may hold patient data


async def test_a_file_changed_between_reads_is_object_changed(tree: Path) -> None:
    path = tree / "archive" / "ct" / "a.dcm"
    async with FileSource(settings_for(f"archive={tree / 'archive'}")) as files:
        where = await files.locate("archive", "ct/a.dcm", None)
        head, _, _ = await files.read_first_then(where, memoryview(bytearray(100)), None)
        replacement = tree / "archive" / "ct" / "new.dcm"
        replacement.write_bytes(path.read_bytes()[::-1])
        replacement.replace(path)  # a new inode at the same path, as a copy tool leaves it
        with pytest.raises(ObjectChanged):
            await files.read_into(where, head, ByteRange(100, 200), memoryview(bytearray(100)))


async def test_a_file_shorter_than_its_range_is_object_changed(tree: Path) -> None:
    path = tree / "archive" / "ct" / "a.dcm"
    async with FileSource(settings_for(f"archive={tree / 'archive'}")) as files:
        where = await files.locate("archive", "ct/a.dcm", None)
        head, _, _ = await files.read_first_then(where, memoryview(bytearray(100)), None)
        with pytest.raises(ObjectChanged):  # past the end of the version it saw
            await files.read_into(
                where, head, ByteRange(head.size - 10, head.size + 10), memoryview(bytearray(20))
            )
        os.truncate(path, 50)
        with pytest.raises(ObjectChanged):
            await files.read_into(where, head, ByteRange(0, 100), memoryview(bytearray(100)))


def test_a_root_that_is_not_a_folder_fails_at_start(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="root archive is not a folder"):
        FileSource(settings_for(f"archive={tmp_path / 'nowhere'}"))


@pytest.mark.parametrize(
    ("code", "error"),
    [
        (errno.ENOENT, ObjectNotFound),
        (errno.EACCES, AccessDenied),
        (errno.EIO, SourceUnavailable),  # a file server away for a moment: retried
        (errno.ESTALE, SourceUnavailable),
        (errno.EINVAL, SourceError),
    ],
)
def test_os_errors_map_onto_the_tree(code: int, error: type[Exception]) -> None:
    translated = translate_file_error(OSError(code, os.strerror(code), "/secret/path"), "read")
    assert type(translated) is error
    assert "/secret/path" not in str(translated)


async def test_transient_errors_are_retried_then_given_up(
    tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = 0
    real = os.preadv

    def flaky(fd: int, buffers: list[memoryview], offset: int) -> int:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise OSError(errno.EIO, "I/O error")
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", flaky)
    async with FileSource(settings_for(f"archive={tree / 'archive'}")) as files:
        where = await files.locate("archive", "ct/a.dcm", None)
        into = bytearray(100)
        await files.read_first_then(where, memoryview(into), None)  # the second try reads
        assert calls == 2
        monkeypatch.setattr(os, "preadv", lambda *_: (_ for _ in ()).throw(OSError(errno.EIO, "")))
        with pytest.raises(SourceUnavailable) as raised:
            await files.read_first_then(where, memoryview(into), None)
        assert raised.value.attempts == 2  # max_attempts


async def test_what_then_raises_is_raised_as_it_is_and_not_retried(tree: Path) -> None:
    calls = 0

    def then(view: memoryview) -> None:
        nonlocal calls
        calls += 1
        raise KeyError("a bug in the parser")

    async with FileSource(settings_for(f"archive={tree / 'archive'}")) as files:
        where = await files.locate("archive", "ct/a.dcm", None)
        with pytest.raises(KeyError):
            await files.read_first_then(where, memoryview(bytearray(16384)), then)
        assert calls == 1


def _kvikio_missing() -> str | None:
    from ingest_gpu.thread import cuda_unavailable_reason

    if importlib.util.find_spec("kvikio") is None:
        return "KvikIO is not installed"
    return cuda_unavailable_reason()


@pytest.mark.gpu
@pytest.mark.skipif(_kvikio_missing() is not None, reason=str(_kvikio_missing()))
async def test_kvikio_reads_what_posix_reads(tree: Path) -> None:
    data = os.urandom(3 * 1024 * 1024 + 17)
    (tree / "archive" / "big.dcm").write_bytes(data)
    got = {}
    for reader in ("posix", "kvikio"):
        settings = settings_for(f"archive={tree / 'archive'}", file_reader=reader, device="cuda")
        async with FileSource(settings) as files:
            assert files.reader == reader
            where = await files.locate("archive", "big.dcm", None)
            head, _, _ = await files.read_first_then(where, memoryview(bytearray(1024)), None)
            into = bytearray(len(data) - 1000)
            await files.read_into(where, head, ByteRange(1000, len(data)), memoryview(into))
            got[reader] = bytes(into)
    assert got["kvikio"] == got["posix"] == data[1000:]
