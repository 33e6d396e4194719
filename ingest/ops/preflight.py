"""Start-up checks: what can be known wrong before the worker joins its consumer group.

``load_settings`` validates each value; these checks go one step further, to
what the values point at: the hook imports and is callable, the audit keyring
and signing key files read and hold keys (and nobody else may read the
keyring), CuPy is there when a hook wants device arrays, and a worker told
``DEVICE=cuda`` has a driver and a device. Each failure is a ``ConfigError``
naming the variable, so ``dicom-ingest worker`` ends with one line and exit
status 2 before it touches the broker, and a supervisor does not restart it
(``ingest/ops/supervisor.py``): a restart could only fail the same way, and
each try would cost the group a rebalance.

Nothing here talks to the network: a server that is down now may be up in a
second, which the worker's retries and ``/readyz`` are for.
"""

from __future__ import annotations

import importlib.util

from ingest.errors import ConfigError
from ingest.settings import PREFIX, Settings


def check_startup(settings: Settings) -> None:
    """Run every start-up check on ``settings``; return when all pass.

    Raises:
        ConfigError: the first check that failed, naming its variable.
    """
    if settings.hook:
        from ingest.hooks import load_hook

        load_hook(settings.hook)  # imports the user's module: its errors show now
    if settings.audit_keyring_file is not None:
        from ingest.audit.keys import read_keyring

        read_keyring(settings.audit_keyring_file)
    if settings.audit_signing_key_file is not None:
        from ingest.audit.digest import load_signing_key

        load_signing_key(settings.audit_signing_key_file)
    cuda = settings.device == "cuda"
    if cuda:
        from ingest_gpu.thread import cuda_unavailable_reason

        why = cuda_unavailable_reason()
        if why is not None:
            raise ConfigError(f"{PREFIX}DEVICE=cuda: {why} (DEVICE=auto falls back to the CPU)")
    if settings.hook and cuda and not _installed("cupy"):
        raise ConfigError(
            f"{PREFIX}HOOK: a hook on the CUDA device is given CuPy arrays; install the extra "
            "`cuda12` or `cuda13`"
        )


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
