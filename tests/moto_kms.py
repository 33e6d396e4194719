"""moto's server (AWS KMS, and S3) as a loopback subprocess, started like Tansu and SeaweedFS.

``moto_server -H 127.0.0.1 -p PORT`` serves every moto service on one port; the
tests use its KMS (``CreateKey``, ``GenerateDataKey``, ``Decrypt`` with an
encryption context) and its S3 (server-side encryption headers). Ready when
``GET /moto-api/`` answers. Static fake credentials: moto accepts any.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from ingest.embedded.server_process import ServerProcess, free_ports

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_REGION": "us-east-1",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class MotoServer(ServerProcess):
    name = "moto"

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.endpoint_url = ""

    def _command(self, new_ports: bool) -> tuple[list[str], dict[str, str]]:
        port = free_ports(1)[0]
        self.endpoint_url = f"http://127.0.0.1:{port}"
        exe = Path(sys.executable).parent / "moto_server"
        return [str(exe), "-H", "127.0.0.1", "-p", str(port)], {"PATH": "/usr/bin:/bin"}

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint_url}/moto-api/", timeout=1) as answer:
                return bool(answer.status == 200)
        except OSError:
            return False


@contextlib.contextmanager
def start_moto() -> Iterator[MotoServer]:
    directory = Path(tempfile.mkdtemp(prefix="dicom-ingest-moto-"))
    server = MotoServer(directory)
    try:
        server._start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(directory, ignore_errors=True)
