"""Start-up checks: a worker whose settings point at something broken fails before it joins
its group, with one line and exit status 2, and a supervisor starts no child.

The broker in these settings does not exist (``127.0.0.1:1``): a worker that got as far as
its group join would end with a ``BrokerError`` and status 1 instead.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ingest.errors import ConfigError
from ingest.ops.preflight import check_startup
from ingest.settings import PREFIX, Settings, load_settings

BASE = {
    PREFIX + "KAFKA_BOOTSTRAP": "127.0.0.1:1",
    PREFIX + "OUTPUT_URL": "s3://out/",
    PREFIX + "AUDIT_KEY": base64.b64encode(bytes(32)).decode(),
}


def settings(**overrides: str) -> Settings:
    return load_settings({**BASE, **{PREFIX + k.upper(): v for k, v in overrides.items()}})


def keyring(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def base_keyring_env() -> dict[str, str]:
    return {k: v for k, v in BASE.items() if k != PREFIX + "AUDIT_KEY"}


@pytest.fixture
def hook_dir(tmp_path: Path) -> Path:
    (tmp_path / "broken_hook.py").write_text("raise RuntimeError('the model file is missing')\n")
    (tmp_path / "not_callable_hook.py").write_text("hook = 3\n")
    return tmp_path


def test_a_hook_that_does_not_import_is_named(
    hook_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(hook_dir))
    with pytest.raises(ConfigError, match=r"HOOK: cannot load 'broken_hook:f': RuntimeError: the"):
        check_startup(settings(hook="broken_hook:f"))
    with pytest.raises(ConfigError, match="HOOK: cannot load 'no_such_module:f'"):
        check_startup(settings(hook="no_such_module:f"))
    with pytest.raises(ConfigError, match="is not callable"):
        check_startup(settings(hook="not_callable_hook:hook"))


def test_a_keyring_with_bad_contents_or_readable_by_others_is_named(tmp_path: Path) -> None:
    good = '{"v": 1, "current": "a", "keys": {"a": "' + base64.b64encode(bytes(32)).decode() + '"}}'
    for text, mode, needle in (
        ("not json", 0o600, "expected"),
        (good, 0o644, "readable by others; chmod 600"),
    ):
        path = keyring(tmp_path / "keyring.json", text, mode)
        s = load_settings({**base_keyring_env(), PREFIX + "AUDIT_KEYRING_FILE": str(path)})
        with pytest.raises(ConfigError, match=needle):
            check_startup(s)
    path = keyring(tmp_path / "keyring.json", good)
    check_startup(load_settings({**base_keyring_env(), PREFIX + "AUDIT_KEYRING_FILE": str(path)}))


def test_a_signing_key_that_is_no_key_is_named(tmp_path: Path) -> None:
    pem = tmp_path / "signing.pem"
    pem.write_text("-----BEGIN PRIVATE KEY-----\nnope\n-----END PRIVATE KEY-----\n")
    with pytest.raises(ConfigError, match="AUDIT_SIGNING_KEY_FILE"):
        check_startup(settings(audit_signing_key_file=str(pem)))


def test_device_cuda_without_a_driver_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        "ingest_gpu.thread.cuda_unavailable_reason", lambda: "no CUDA device is visible"
    )
    with pytest.raises(ConfigError, match="DEVICE=cuda: no CUDA device is visible"):
        check_startup(settings(device="cuda"))
    check_startup(settings(device="auto"))  # auto falls back to the CPU: nothing to refuse


def run_worker(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}
    return subprocess.run(
        [sys.executable, "-m", "ingest.cli", "worker", *args],
        env={**clean, **env, PREFIX + "LOG_FORMAT": "json"},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("processes", ["1", "3"])
def test_the_worker_fails_before_the_group_in_one_json_line_and_is_not_restarted(
    hook_dir: Path, processes: str
) -> None:
    env = {**BASE, PREFIX + "HOOK": "broken_hook:f", "PYTHONPATH": _pythonpath(hook_dir)}
    done = run_worker(env, "--processes", processes)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.splitlines()  # one line: no traceback, no supervisor, no child
    record = json.loads(line)
    assert record["event"] == "configuration error"
    assert record["error"].startswith("DICOM_INGEST_HOOK: cannot load 'broken_hook:f'")
    assert (record["exit_status"], record["level"], record["service"]) == (
        2,
        "error",
        "dicom-ingest",
    )
    assert done.stdout == ""


def test_an_unknown_variable_stops_the_worker_in_one_line_naming_the_nearest() -> None:
    done = run_worker({**BASE, PREFIX + "PARTSIZE": "1"})
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert json.loads(line)["error"] == (
        "DICOM_INGEST_PARTSIZE: not a setting; did you mean DICOM_INGEST_PART_SIZE?"
    )


def _pythonpath(extra: Path) -> str:
    return os.pathsep.join([str(extra), *filter(None, [os.environ.get("PYTHONPATH")])])
